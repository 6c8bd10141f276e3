"""`splitserve worker` around vLLM's process group: nothing of the group outlives its leader,
and cores this process may not use are refused before anything starts.

vLLM is simulated by a shell whose leader exits while a child it started (as vLLM's API server
leaves its `EngineCore`) lives on in its group, holding the output pipe."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.worker.cli import supervise
from splitserve.worker.launch import free_port


class Captured:
    """sys.stdout with a bytes buffer, where the pump writes vLLM's output."""

    def __init__(self) -> None:
        self.buffer = BytesIO()


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """`supervise` installs its own SIGINT and SIGTERM handlers: give pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp, ...
            out.append(int(entry))
    return out


def test_the_rest_of_the_group_ends_with_its_leader(monkeypatch: pytest.MonkeyPatch,
                                                    signal_handlers: None) -> None:
    out = Captured()
    monkeypatch.setattr("sys.stdout", out)
    started = time.monotonic()
    code = supervise(["sh", "-c", "sleep 30 & echo $$; exit 3"], dict(os.environ), None)
    assert code == 3
    assert time.monotonic() - started < 5, "supervise waited for the engine's output"
    leader = int(out.buffer.getvalue().split()[0])
    assert group_members(leader) == []


def test_worker_refuses_cores_it_may_not_use(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")  # only the cores are wrong
    usable = sorted(os.sched_getaffinity(0))
    beyond = usable[-1] + 1
    code = main(["worker", "--model", str(tmp_path), "--port", str(free_port()),
                 "--cpus", f"{usable[0]},{beyond}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve worker: --cpus: core(s) {beyond} not available to this "
                          "process (it may use "), err
    assert "Traceback" not in err
