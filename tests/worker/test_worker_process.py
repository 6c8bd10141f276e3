"""A worker's private directory goes with its leader process (`WorkerProcess`), and a start
that fails leaves none (`start_worker`)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from splitserve.common.privatedir import RUNTIME_DIR_ENV, WORKER_DIR_ENV, private_dir
from splitserve.config import WorkerConfig
from splitserve.worker.launch import WorkerProcess, start_worker


def leader(code: str) -> tuple[WorkerProcess, str]:
    directory = private_dir()
    env = dict(os.environ) | {WORKER_DIR_ENV: directory}
    return WorkerProcess([sys.executable, "-c", code], env), directory


def test_the_directory_is_removed_when_the_leader_is_reaped() -> None:
    proc, directory = leader("pass")
    assert proc.wait(30) == 0 and not os.path.exists(directory)
    proc, directory = leader("import time; time.sleep(0.5)")
    assert proc.poll() is None and os.path.isdir(directory)  # running: kept
    deadline = time.monotonic() + 30
    while proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not os.path.exists(directory)


def test_a_start_that_fails_leaves_no_directory(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    runtime = tempfile.mkdtemp(dir="/tmp")  # short: room for socket paths
    monkeypatch.setenv(RUNTIME_DIR_ENV, runtime)
    try:
        for kv_events in (True, False):  # a worker has its directory either way
            cfg = WorkerConfig(model=str(tmp_path), port=8000, kv_events=kv_events)
            with pytest.raises(ValueError, match="null"):  # the environment cannot be passed on
                start_worker(cfg, "token", extra_env={"BAD": "a\0b"})
            assert os.listdir(runtime) == []
    finally:
        os.rmdir(runtime)
