"""`splitserve worker` as a user runs it: a Hugging Face id from an offline hub cache, served
under that id at the model's own length; vLLM's output passes through, SIGTERM reaches vLLM,
the command exits with vLLM's status and no process of it outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from splitserve.worker.launch import free_port
from tests.support.cli import splitserve_argv
from tests.support.workers import hub_cache

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def group_alive(pgid: int) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                return True
    return False


def test_worker_command_serves_a_hub_id_and_stops_on_sigterm(llama_ckpt: Path, tmp_path: Path
                                                            ) -> None:
    hub_cache(tmp_path / "hf", "org/tiny", llama_ckpt, COMMIT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE", "SPLITSERVE_TOKEN"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    port = free_port()
    out_path = tmp_path / "worker.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            splitserve_argv("worker", "--model", "org/tiny", "--port", str(port)),
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    vllm_group = None
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, "worker not healthy in time"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        assert model["id"] == "org/tiny" and model["max_model_len"] == 2048
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "org/tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) ==
                    proc.pid]
        assert len(children) == 1  # vLLM, in a process group of its own
        vllm_group = os.getpgid(children[0])
        assert vllm_group != os.getpgid(proc.pid)
        proc.send_signal(signal.SIGTERM)  # to the command only: it passes the signal on
        assert proc.wait(60) == 0, out_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    said = out_path.read_text()
    assert "splitserve worker: vLLM 0.32.0, role=plain" in said
    assert "Application startup complete" in said  # vLLM's own output passed through
    deadline = time.monotonic() + 20
    while vllm_group is not None and group_alive(vllm_group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vllm_group is None or not group_alive(vllm_group)


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
