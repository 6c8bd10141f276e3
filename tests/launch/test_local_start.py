"""`LocalDeployment`'s start and stop around workers that fail: the first failure ends the start
at once, whichever worker it is; nothing a worker was given outlives it; a part that cannot be
stopped is reported.

Outside facts are simulated, never splitserve's own code: vLLM's server is replaced by a
stand-in process per worker (`StandIns._popen`, the one method that runs vLLM's command), and a
process the kernel will not let go by a `Popen` whose wait never succeeds."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.common.privatedir import RUNTIME_DIR_ENV, WORKER_DIR_ENV
from splitserve.launch.config import DeploymentConfig
from splitserve.launch.local import EXIT_S, Child, LocalDeployment
from splitserve.worker.launch import free_port

SLEEPS = "import time; time.sleep(60)"  # a vLLM still loading: never healthy in the test
# a worker that comes up (its /health answers on the port its command line names), then dies
UP_THEN_DIES = """
import http.server, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(4)
sys.exit(3)
"""
CRASHES = "import sys; print('RuntimeError: CUDA out of memory'); sys.exit(1)"


class StandIns(LocalDeployment):
    """Runs `scripts[name]` for the worker `name` in place of vLLM, in the environment and
    session vLLM would get; a name mapped to an exception fails to start with it."""

    def __init__(self, cfg: DeploymentConfig, scripts: dict[str, str | BaseException]) -> None:
        super().__init__(cfg, say=lambda line: None)
        self.scripts = scripts
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        self.runtime_dirs: list[str] = []

    def _popen(self, argv: list[str], env: dict[str, str], cpus: tuple[int, ...] | None,
               log: Path) -> subprocess.Popen[bytes]:
        if WORKER_DIR_ENV in env:  # a worker's (a router has none)
            self.runtime_dirs.append(env[WORKER_DIR_ENV])
        script = self.scripts[log.stem]
        if isinstance(script, BaseException):
            raise script
        with open(log, "ab") as out:
            port = argv[argv.index("--port"):argv.index("--port") + 2]  # the stand-in's
            proc = subprocess.Popen([sys.executable, "-c", script, *port], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started[log.stem] = proc
        return proc


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where workers' private directories are made (short: they hold Unix sockets)."""
    with tempfile.TemporaryDirectory(prefix="ss-rt-") as path:
        monkeypatch.setenv(RUNTIME_DIR_ENV, path)
        yield Path(path)


def pd_config(tmp_path: Path, timeout_s: float = 30.0) -> DeploymentConfig:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return DeploymentConfig(prefill=1, decode=1, model=str(model), startup_timeout_s=timeout_s,
                            stop_timeout_s=5.0, port=free_port(), log_dir=str(tmp_path / "logs"))


def test_a_worker_that_crashes_at_once_fails_the_start_at_once(tmp_path: Path,
                                                               runtime_dir: Path) -> None:
    """The crash of a later worker is not held back by an earlier one still loading."""
    dep = StandIns(pd_config(tmp_path), {"prefill0": SLEEPS, "decode1": CRASHES})
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        dep.start()
    assert time.monotonic() - started < 10, "the crash waited for prefill0"
    message = str(err.value)
    assert message.startswith("decode1 did not start: worker "), message
    assert "exited with code 1 while starting" in message
    assert message.endswith("its log ends: RuntimeError: CUDA out of memory"), message
    loading = dep.started["prefill0"]
    assert loading.poll() is not None, "the worker still loading was not stopped"
    assert dep.children == []


def test_a_worker_that_dies_while_the_router_starts_fails_the_start_at_once(
        tmp_path: Path, runtime_dir: Path) -> None:
    """The router is healthy only once a P and a D are in rotation: a worker that dies after
    it came up ends the router's wait at once, naming that worker (not after
    `startup_timeout_s`)."""
    dep = StandIns(pd_config(tmp_path, timeout_s=120),
                   {"prefill0": UP_THEN_DIES.replace("time.sleep(4)", "time.sleep(60)"),
                    "decode1": UP_THEN_DIES, "router": SLEEPS})
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"router did not start: decode1 exited with code 3"):
        dep.start()
    assert time.monotonic() - started < 60
    assert all(p.poll() is not None for p in dep.started.values())
    assert dep.children == []


def test_a_failing_start_leaves_no_runtime_directory(tmp_path: Path,
                                                     runtime_dir: Path) -> None:
    """One worker's crashed before its engine was up, the other's stopped while loading."""
    dep = StandIns(pd_config(tmp_path), {"prefill0": CRASHES, "decode1": SLEEPS})
    with pytest.raises(RuntimeError, match="prefill0 did not start"):
        dep.start()
    assert len(dep.runtime_dirs) == 2
    assert all(Path(d).parent == runtime_dir for d in dep.runtime_dirs)
    assert list(runtime_dir.iterdir()) == []


def test_a_worker_that_cannot_be_spawned_leaves_no_runtime_directory(
        tmp_path: Path, runtime_dir: Path) -> None:
    dep = StandIns(pd_config(tmp_path), {"prefill0": SLEEPS,
                                         "decode1": OSError("exec format error")})
    with pytest.raises(OSError, match="exec format error"):
        dep.start()
    assert len(dep.runtime_dirs) == 2
    assert dep.started["prefill0"].poll() is not None
    assert list(runtime_dir.iterdir()) == []


class Unreapable(subprocess.Popen[bytes]):
    """A leader the kernel never lets go (e.g. stuck in uninterruptible I/O): signals reach
    the real process, but waiting for it never succeeds."""

    def poll(self, *args: Any, **kw: Any) -> int | None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired(self.args, timeout or 0)


def test_stop_reports_a_worker_not_reaped_after_sigkill_and_stops_the_rest(
        tmp_path: Path) -> None:
    dep = LocalDeployment(pd_config(tmp_path), say=lambda line: None)
    dep.log_dir.mkdir(parents=True)
    stuck = Unreapable([sys.executable, "-c", SLEEPS], start_new_session=True)
    fine = subprocess.Popen([sys.executable, "-c", SLEEPS], start_new_session=True)
    try:
        url = "http://127.0.0.1:1"
        dep.children += [Child("prefill0", url, stuck, dep.log_dir / "prefill0.log", [], {}, None),
                         Child("decode1", url, fine, dep.log_dir / "decode1.log", [], {}, None)]
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"not reaped even after SIGKILL: prefill0 "
                                               f"\\(pid {stuck.pid}, log "):
            dep.stop()
        assert time.monotonic() - started < dep.cfg.stop_timeout_s + EXIT_S + 10
        assert fine.poll() is not None  # the rest is stopped all the same
        assert dep.children == []
        dep.stop()  # called again: nothing left to report
    finally:
        subprocess.Popen.wait(stuck)  # SIGKILLed above: reap it for real
        fine.kill()
        fine.wait()
