"""The guard (`common.guard`): a worker's process group goes with it however it ends (its
parent killed, itself killed, its child exiting on its own or on SIGTERM), and the worker's
private directory with the group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from splitserve.common.guard import guarded
from splitserve.common.privatedir import WORKER_DIR_ENV, private_dir


def test_the_guard_takes_its_whole_group_down_with_its_parent(tmp_path: Path) -> None:
    """A parent starts the guard (new session) around a child that forks a grandchild (as
    vLLM's API server forks its EngineCore); SIGKILL the parent: all of them go."""
    pids = tmp_path / "pids"
    tree = (f"import os, time; pid = os.fork()\n"
            f"if pid == 0: time.sleep(600)\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{pid}}'); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-m', 'splitserve.common.guard', "
        f"sys.executable, '-c', {tree!r}], start_new_session=True)\n"
        "time.sleep(600)")], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 30
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child, grandchild = map(int, pids.read_text().split())
    finally:  # the parent's death is what the guard answers: it takes the tree down either way
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (alive(child) or alive(grandchild)):
        time.sleep(0.1)
    assert not alive(child) and not alive(grandchild)


def test_the_guard_takes_its_whole_group_down_when_it_is_sigkilled(tmp_path: Path) -> None:
    """Ray's core worker SIGKILLs its direct children (the guard) when it exits: the guard's
    sentinel takes the rest of the group (the worker and what it forked) down."""
    pids = tmp_path / "pids"
    tree = (f"import os, time; pid = os.fork()\n"
            f"if pid == 0: time.sleep(600)\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{pid}}'); time.sleep(600)")
    guard = subprocess.Popen([sys.executable, "-m", "splitserve.common.guard",
                              sys.executable, "-c", tree], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child, grandchild = map(int, pids.read_text().split())
        time.sleep(0.5)  # the sentinel has armed its death signal
    finally:
        guard.send_signal(signal.SIGKILL)
        guard.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (alive(child) or alive(grandchild)):
        time.sleep(0.1)
    left = [p for p in (child, grandchild) if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == []


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def test_the_guard_exits_with_its_childs_status_and_leaves_no_grandchild(tmp_path: Path) -> None:
    """ARGV exits on its own (status 3) after forking a grandchild that would outlive it: the
    guard kills the grandchild and reports 3, not its own SIGKILL."""
    pids = tmp_path / "pids"
    tree = (f"import os, sys, time; pid = os.fork()\n"
            f"if pid == 0: time.sleep(600)\n"
            f"open({str(pids)!r}, 'w').write(str(pid)); sys.exit(3)")
    guard = subprocess.Popen(
        [sys.executable, "-m", "splitserve.common.guard", sys.executable, "-c", tree],
        start_new_session=True, env=dict(os.environ))
    try:
        assert guard.wait(timeout=30) == 3
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)
    grandchild = int(pids.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(grandchild):
        time.sleep(0.1)
    assert not alive(grandchild)


def test_a_sigtermed_guard_exits_as_soon_as_its_child_has(tmp_path: Path) -> None:
    """SIGTERM reaches ARGV, which exits at once (as an idle vLLM server does): the guard exits
    with its status then, not when its grace (30 s here) would have run out."""
    ready = tmp_path / "ready"
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
             f"open({str(ready)!r}, 'w').write('1'); time.sleep(600)")
    guard = subprocess.Popen(
        [sys.executable, "-m", "splitserve.common.guard", sys.executable, "-c", child],
        start_new_session=True, env=dict(os.environ, SPLITSERVE_GUARD_GRACE_S="30"))
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=25) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)


def test_a_child_killed_by_a_signal_is_reported_as_a_shell_reports_it() -> None:
    guard = subprocess.Popen(guarded([sys.executable, "-c",
                                      "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]),
                             start_new_session=True)
    assert guard.wait(timeout=30) == 128 + signal.SIGKILL


def test_the_workers_private_directory_goes_with_the_group(tmp_path: Path) -> None:
    """Whichever way the group ends (its child exits; its parent is killed), the directory in
    `WORKER_DIR_ENV` is removed: a killed launcher leaves no socket directory behind."""
    directory = private_dir()
    guard = subprocess.Popen(guarded([sys.executable, "-c", "pass"]), start_new_session=True,
                             env=dict(os.environ, **{WORKER_DIR_ENV: directory}))
    assert guard.wait(timeout=30) == 0 and not os.path.exists(directory)

    directory = private_dir()
    ready = tmp_path / "ready"
    child = guarded([sys.executable, "-c",
                     f"open({str(ready)!r}, 'w'); import time; time.sleep(600)"])
    parent = subprocess.Popen([sys.executable, "-c", (
        f"import subprocess, time; subprocess.Popen({child!r}, start_new_session=True); "
        "time.sleep(600)")], env=dict(os.environ, **{WORKER_DIR_ENV: directory}))
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists() and os.path.isdir(directory)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(directory):
        time.sleep(0.1)
    assert not os.path.exists(directory)
