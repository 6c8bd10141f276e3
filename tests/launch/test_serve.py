"""`splitserve serve` end to end: a 1P+1D+1 colocated deployment on loopback from a YAML file
(flags overriding), requests through it, then SIGTERM: every process gone, token never on a
command line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from splitserve.worker.launch import free_port


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def cmdlines() -> dict[int, str]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "
                                                                                  ).decode()
            except OSError:
                continue
    return out


def test_serve_starts_answers_and_stops_without_orphans(llama_ckpt: Path, tmp_path: Path
                                                         ) -> None:
    port = free_port()
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"prefill: 1\ndecode: 1\ncolocated: 1\nmodel: {llama_ckpt}\n"
                   "max_model_len: 2048\nport: 1\n")
    log_dir = tmp_path / "logs"
    out = open(tmp_path / "serve.out", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "serve", "--config", str(cfg), "--port",
         str(port), "--transport", "shm", "--log-dir", str(log_dir)],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "ready" not in (tmp_path / "serve.out").read_text():
            assert proc.poll() is None, (tmp_path / "serve.out").read_text()
            assert time.monotonic() < deadline, "deployment not ready in time"
            time.sleep(0.5)
        said = (tmp_path / "serve.out").read_text()
        assert f"{url}/v1" in said and "cores:" in said
        children = descendants(proc.pid)
        assert len(children) >= 4  # three workers (each with its engine) and the router
        workers = [line.split()[2] for line in said.splitlines()
                   if re.match(r"splitserve: (prefill|decode|colocated)\d+ ", line)]
        assert len(workers) == 3, said
        roles = {w["role"] for w in httpx.get(f"{url}/workers").json()["workers"]}
        assert roles == {"prefill", "decode", "colocated"}

        body = {"model": str(llama_ckpt), "prompt": "Over the hills", "max_tokens": 6,
                "temperature": 0}
        split = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert split.status_code == 200, split.text
        timings = json.loads(split.headers["x-splitserve-timings"])
        assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
        whole = httpx.post(f"{url}/v1/completions", json=body | {"n": 2}, timeout=60)
        assert whole.status_code == 200 and len(whole.json()["choices"]) == 2
        assert whole.json()["choices"][0]["text"] == split.json()["choices"][0]["text"]
        # the generated token reaches children in their environment, never their command line
        tokens = set()
        for pid in children:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            tokens |= {e.split(b"=", 1)[1].decode() for e in env
                       if e.startswith(b"SPLITSERVE_TOKEN=")}
        assert len(tokens) == 1
        assert not any(tokens.pop() in cmd for cmd in cmdlines().values())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        out.close()
    assert proc.returncode == 0, (tmp_path / "serve.out").read_text()
    for w in workers:
        try:
            httpx.get(f"{w}/health", timeout=2)
            raise AssertionError(f"{w} still answers after shutdown")
        except httpx.TransportError:
            pass
    leftover = [pid for pid in children if alive(pid)]
    assert leftover == [], leftover
