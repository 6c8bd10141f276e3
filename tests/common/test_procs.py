"""`splitserve.common.procs.stop_group(s)` on real child processes: each test starts a group
leader (`start_new_session=True`) that prints one line once its signal handlers and its group's
other members are in place, then stops it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from splitserve.common.procs import stop_group, stop_groups

IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
# a member of the leader's group, in the background: its pid is the leader's first line
MEMBER = ("import subprocess, sys\n"
          "m = subprocess.Popen([sys.executable, '-c', {code!r}])\n")
SLEEP = "import time\ntime.sleep(120)\n"


def leader(body: str) -> tuple[subprocess.Popen[bytes], str]:
    """A group leader running `body`, then printing `said` (its first line), then sleeping."""
    code = body + "print(said, flush=True)\nimport time\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode().strip()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    """Group ids to SIGKILL after the test, whatever it left."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def test_a_leader_that_exits_on_sigterm_is_not_killed(cleanup: list[int]) -> None:
    proc, _ = leader("said = 'up'\n")
    cleanup.append(proc.pid)
    start = time.monotonic()
    assert stop_group(proc, 20.0) == -signal.SIGTERM
    assert time.monotonic() - start < 5


def test_a_leader_that_ignores_sigterm_is_killed_after_the_grace(cleanup: list[int]) -> None:
    """SIGTERM first (the leader says it got it, and goes on), SIGKILL only once the grace is
    over: never before it, and not long after."""
    noted = ("import signal, sys\n"
             "signal.signal(signal.SIGTERM, lambda *_: print('term', flush=True))\n")
    proc, _ = leader(noted + "said = 'up'\n")
    cleanup.append(proc.pid)
    grace_s, reap_s = 1.0, 5.0
    start = time.monotonic()
    assert stop_group(proc, grace_s, reap_s=reap_s) == -signal.SIGKILL
    elapsed = time.monotonic() - start
    assert proc.stdout is not None and proc.stdout.read().decode().split() == ["term"]
    # the contract: the whole grace is given before SIGKILL, and the kill is reaped within
    # reap_s (a leader not reaped by then would have returned None above)
    assert grace_s <= elapsed < grace_s + reap_s


def test_sigterm_reaches_the_whole_group_and_sigkill_the_members_that_ignore_it(
        cleanup: list[int]) -> None:
    """A member that exits on SIGTERM got it too; one ignoring it is SIGKILLed with the group
    when its leader outlives the grace."""
    body = (IGNORE_TERM + MEMBER.format(code=SLEEP)
            + "n = subprocess.Popen([sys.executable, '-c', " + repr(IGNORE_TERM + SLEEP) + "])\n"
            + "import time; time.sleep(0.5)\n"  # both members have started (and set handlers)
            + "said = f'{m.pid} {n.pid}'\n")
    proc, said = leader(body)
    cleanup.append(proc.pid)
    dies_on_term, ignores_term = map(int, said.split())
    assert stop_group(proc, 1.0) == -signal.SIGKILL
    assert gone_within(dies_on_term, 5) and gone_within(ignores_term, 5)


def test_members_outliving_their_leader_are_swept_only_when_asked(cleanup: list[int]) -> None:
    for sweep in (False, True):
        proc, said = leader(MEMBER.format(code=IGNORE_TERM + SLEEP)
                            + "import time; time.sleep(0.5)\nsaid = str(m.pid)\n")
        cleanup.append(proc.pid)
        member = int(said)
        assert stop_group(proc, 5.0, sweep=sweep) == -signal.SIGTERM
        if sweep:
            assert gone_within(member, 5)
        else:
            time.sleep(0.3)
            assert alive(member)  # it ignores SIGTERM, and nothing else was sent


def test_term_to_the_leader_alone_leaves_the_members_to_it(cleanup: list[int]) -> None:
    """`term="leader"`: only the leader gets SIGTERM (here it exits 7 on it); the member, which
    would die of a SIGTERM, is untouched until the sweep."""
    body = (MEMBER.format(code=SLEEP)
            + "import signal, os\n"
            + "signal.signal(signal.SIGTERM, lambda *a: os._exit(7))\n"
            + "import time; time.sleep(0.5)\nsaid = str(m.pid)\n")
    proc, said = leader(body)
    cleanup.append(proc.pid)
    member = int(said)
    assert stop_group(proc, 5.0, term="leader") == 7
    assert alive(member)
    proc, said = leader(body)
    cleanup.append(proc.pid)
    member = int(said)
    assert stop_group(proc, 5.0, term="leader", sweep=True) == 7
    assert gone_within(member, 5)


def test_a_leader_already_exited_is_not_signalled(cleanup: list[int]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                            start_new_session=True)
    proc.wait(30)
    assert stop_group(proc, 5.0) == 3
    assert stop_group(proc, 5.0, sweep=True) == 3  # its group is gone: nothing to kill


def test_groups_drain_side_by_side_within_one_grace(cleanup: list[int]) -> None:
    """Every group gets SIGTERM before any is waited for: two leaders that each take 1.5 s to
    exit are both done within one grace period; one that ignores SIGTERM is killed at its end."""
    slow = "import signal, time, os\nsignal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), os._exit(0)))\n"  # noqa: E501
    procs = [leader(slow + "said = 'up'\n")[0] for _ in range(2)]
    procs.append(leader(IGNORE_TERM + "said = 'up'\n")[0])
    cleanup.extend(p.pid for p in procs)
    start = time.monotonic()
    assert stop_groups(procs, 2.5) == [0, 0, -signal.SIGKILL]
    assert 2.5 <= time.monotonic() - start < 5
