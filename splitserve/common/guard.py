"""`python -m splitserve.common.guard ARGV...` (`guarded(argv)`): run ARGV as the child of a
process group leader that takes the whole group down with it. vLLM's engine processes do not
die with their API server, so every worker runs under one: started by the local launcher, by
`splitserve worker`, by a Ray replica; a Ray router host runs its router under one too.

Invariants:
- The guard leads its own session and process group (its parent starts it with
  `start_new_session=True`); ARGV and everything ARGV starts (vLLM's `EngineCore` included)
  stay in that group.
- The guard gets SIGTERM when its parent (a launcher, a Ray replica or actor) dies
  (PR_SET_PDEATHSIG), however the parent died (SIGKILL included).
- The guard itself may be SIGKILLed (a parent's PR_SET_PDEATHSIG; Ray's core worker kills its
  direct children when it exits, e.g. when its node is lost). A sentinel process in the group
  (`--sentinel`), started first, gets SIGTERM when the guard dies and SIGKILLs the whole group
  then, so vLLM's API server and `EngineCore` never outlive their guard.
- Whoever of the two takes the group down removes ARGV's private directory first
  (`WORKER_DIR_ENV` in its environment, `common.privatedir`).
- On SIGTERM it forwards SIGTERM to ARGV (vLLM drains for its `--shutdown-timeout`), waits up to
  `SPLITSERVE_GUARD_GRACE_S` (default 30; 0 when the parent is already gone), then SIGKILLs the
  whole group. When ARGV exits on its own, the rest of the group is SIGKILLed too (no engine
  process outlives its API server) and the guard exits with ARGV's status (128 + N for a
  death by signal N).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from splitserve.common.privatedir import remove_worker_dir

PR_SET_PDEATHSIG = 1
GRACE_ENV = "SPLITSERVE_GUARD_GRACE_S"


def guarded(argv: list[str]) -> list[str]:
    """The command that runs `argv` under a guard (start it with `start_new_session=True`,
    `GRACE_ENV` in its environment)."""
    return [sys.executable, "-m", "splitserve.common.guard", *argv]


def kill_group() -> None:
    remove_worker_dir(os.environ)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(0), signal.SIGKILL)


def kill_rest_of_group() -> None:
    """SIGKILL every member of our process group but ourselves (so our exit status stays the
    child's)."""
    me, group = os.getpid(), os.getpgid(0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:  # the fields after the name: state, ppid, pgrp, ...
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def die_with_parent() -> int:
    """Arm SIGTERM on the parent's death; the parent's pid, or 0 when it is already gone."""
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return parent if os.getppid() == parent else 0


def sentinel(guard: int) -> int:
    """Wait for the guard's death (however it died), then SIGKILL the whole group."""
    signal.signal(signal.SIGTERM, lambda signum, frame: kill_group())
    if die_with_parent() != guard:
        kill_group()
    while True:
        signal.pause()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m splitserve.common.guard ARGV...", file=sys.stderr)
        return 2
    if argv[0] == "--sentinel":
        return sentinel(int(argv[1]))
    parent = die_with_parent()
    if not parent:  # the parent died before the death signal was armed
        return 1
    grace = float(os.environ.pop(GRACE_ENV, "30"))
    subprocess.Popen(guarded(["--sentinel", str(os.getpid())]), stdin=subprocess.DEVNULL)
    child = subprocess.Popen(argv)
    stopping = threading.Event()
    # a daemon: once ARGV has exited, the guard exits at once with its status (a pending
    # timer must not hold the interpreter for the rest of the grace)
    deadline = threading.Timer(grace, kill_group)
    deadline.daemon = True

    def on_term(signum: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            return
        stopping.set()
        if os.getppid() != parent:  # our replica is gone: nobody waits for a drain
            kill_group()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        deadline.start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = child.wait()
    deadline.cancel()
    kill_rest_of_group()
    remove_worker_dir(os.environ)
    return 128 - code if code < 0 else code  # a signal's death as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
