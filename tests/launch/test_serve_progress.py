"""`splitserve serve` says when each part is ready, and which one failed and why (issue 28,
item 5): the launcher's wait on stand-in processes (no vLLM): a static HTTP server that answers
/health, and one that dies printing a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.launch.config import DeploymentConfig
from splitserve.launch.local import Child, LocalDeployment, last_log_line
from splitserve.worker.launch import free_port

TRACEBACK = """INFO 12-02 loading weights
Traceback (most recent call last):
  File "x.py", line 1, in <module>
    boom()
    ^^^^^^
ValueError: the checkpoint's tokenizer.json is not valid JSON

RuntimeError: Engine core initialization failed. See root cause above.
"""


def deployment(tmp_path: Path) -> tuple[LocalDeployment, list[str]]:
    said: list[str] = []
    dep = LocalDeployment(DeploymentConfig(colocated=1, startup_timeout_s=30,
                                           log_dir=str(tmp_path)), say=said.append)
    return dep, said


def child(tmp_path: Path, name: str, argv: list[str], port: int) -> Child:
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    return Child(name, f"http://127.0.0.1:{port}", proc, log, argv, {}, None)


def test_the_last_meaningful_line_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(TRACEBACK)
    assert last_log_line(log) == "ValueError: the checkpoint's tokenizer.json is not valid JSON"
    assert last_log_line(tmp_path / "none.log") is None


def test_a_worker_that_dies_is_named_with_its_logs_last_line(tmp_path: Path) -> None:
    dep, said = deployment(tmp_path)
    script = f"import sys; sys.stdout.write({TRACEBACK!r}); sys.exit(1)"
    c = child(tmp_path, "decode1", [sys.executable, "-c", script], free_port())
    with pytest.raises(RuntimeError) as err:
        dep._wait_ready(c, None)
    message = str(err.value)
    assert message.startswith(f"decode1 did not start: worker {c.url} exited with code 1 "
                              "while starting"), message
    assert message.endswith("; its log ends: ValueError: the checkpoint's tokenizer.json is "
                            "not valid JSON")
    assert not any("ready" in line for line in said)


def test_each_part_says_when_it_is_ready(tmp_path: Path) -> None:
    dep, said = deployment(tmp_path)
    (tmp_path / "health").write_text("ok")  # a static server's /health answers 200
    port = free_port()
    c = child(tmp_path, "prefill0", [sys.executable, "-m", "http.server", str(port),
                                     "--bind", "127.0.0.1"], port)
    try:
        dep._wait_ready(c, None)
    finally:
        c.proc.terminate()
        c.proc.wait(10)
    assert len(said) == 1 and said[0].startswith("splitserve: prefill0 ready ("), said
