"""Stopping a child that leads its own process group: SIGTERM, a grace period, then SIGKILL.

Every process splitserve starts (a worker, a router, a Ray replica's guard) is started with
`start_new_session=True`, so it leads a process group that holds everything it starts in turn
(vLLM's `EngineCore` included). `stop_groups` is the one place that stops such groups.

Contract of `stop_groups(procs, grace_s, ...)`:
- Each `proc` must lead its own process group (its pid is its group's id).
- SIGTERM goes to each group whose leader is still running: to the whole group (default), or to
  the leader alone (`term="leader"`, for a leader that passes the signal on itself and whose
  group holds a member that SIGKILLs the group on SIGTERM, as the Ray backend's guard does).
  All are signalled before any is waited for, so they drain side by side.
- Then it waits until every leader has exited or `grace_s` has passed (one deadline for all).
- Then each group whose leader outlived the grace is SIGKILLed. With `sweep=True` every group is
  SIGKILLed, the exited leaders' too: members (an engine process) may outlive their leader.
- Then it waits up to `reap_s` for each leader to be reaped (`None`: as long as it takes).
- A group or leader already gone is not an error (nor is a member that is not ours to signal).
  A leader already exited on entry is neither signalled nor waited for (only swept).
- Returns each leader's exit status (negative: the signal that ended it), or None for a leader
  still not reaped after `reap_s`; never raises `subprocess.TimeoutExpired`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Literal

Popen = subprocess.Popen[Any]  # of any output type: only its pid, poll, wait and send_signal


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait(proc: Popen, timeout_s: float | None) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def stop_groups(procs: Sequence[Popen], grace_s: float, *,
                term: Literal["group", "leader"] = "group", sweep: bool = False,
                reap_s: float | None = 10.0) -> list[int | None]:
    """Stop every group led by `procs` (see the module's contract); their exit statuses."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        if term == "group":
            _signal_group(proc.pid, signal.SIGTERM)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, grace_s)
    for proc in running:
        _wait(proc, max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if sweep or (proc in running and proc.poll() is None):
            _signal_group(proc.pid, signal.SIGKILL)
    return [_wait(proc, reap_s) for proc in procs]


def stop_group(proc: Popen, grace_s: float, *, term: Literal["group", "leader"] = "group",
               sweep: bool = False, reap_s: float | None = 10.0) -> int | None:
    """`stop_groups` for one group: SIGTERM, up to `grace_s` to exit, then SIGKILL; the
    leader's exit status, or None if it was not reaped within `reap_s` of the SIGKILL."""
    return stop_groups([proc], grace_s, term=term, sweep=sweep, reap_s=reap_s)[0]
