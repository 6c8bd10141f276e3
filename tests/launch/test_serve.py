"""`splitserve serve` end to end: a 1P+1D deployment over shared memory on loopback, from a YAML
file with flags overriding it, behind two routers; greedy output of concurrent mixed-length
requests through both equals Hugging Face transformers; each router counts the other as its peer;
a router that is killed is started again on its port while the other serves; the token never on
a command line; then the launcher is killed with SIGKILL: every process of the deployment gone
(vLLM's engine processes included) and the workers' private directories removed.
(1P+1D, not 2P+2D: with the session's other workers alive, four more do not fit in this machine's
memory; choosing among several P and D is covered by the router's policy and flow tests.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from splitserve.worker.launch import free_port
from tests.support.cli import splitserve_argv
from tests.support.workers import hf_greedy


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


def environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_serve_starts_answers_and_stops_without_orphans(llama_ckpt: Path, tmp_path: Path
                                                         ) -> None:
    port = free_port(count=2)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"prefill: 1\ndecode: 2\nmodel: {llama_ckpt}\nrouters: 2\n"
                   "max_model_len: 2048\nport: 1\nrouter: {decode_policy: round_robin}\n"
                   # D drafts (the random model's drafts are never accepted); P never does
                   "speculative: {method: ngram, num_speculative_tokens: 2, "
                   "prompt_lookup_max: 3}\n")
    log_dir = tmp_path / "logs"
    out = open(tmp_path / "serve.out", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        splitserve_argv("serve", "--config", str(cfg), "--port", str(port), "--decode", "1",
                        "--transport", "shm", "--log-dir", str(log_dir)),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url, url2 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    try:
        deadline = time.monotonic() + 300
        while "splitserve: ready" not in (tmp_path / "serve.out").read_text():
            assert proc.poll() is None, (tmp_path / "serve.out").read_text()
            assert time.monotonic() < deadline, "deployment not ready in time"
            time.sleep(0.5)
        said = (tmp_path / "serve.out").read_text()
        assert f"{url}/v1" in said and f"{url2}/v1" in said and "cores:" in said
        children = descendants(proc.pid)
        assert len(children) >= 4  # two workers (each with its engine) and two routers
        workers = [line.split()[2] for line in said.splitlines()
                   if re.match(r"splitserve: (prefill|decode)\d+ http", line)]
        assert len(workers) == 2, said
        roles = sorted(w["role"] for w in httpx.get(f"{url}/workers").json()["workers"])
        assert roles == ["decode", "prefill"]

        prompts = [[3 + (s * 29 + i * 7) % 1000 for i in range(n)]
                   for s, n in enumerate((5, 60, 200, 333, 17, 128))]

        def generate(prompt: list[int], front: str = url) -> httpx.Response:
            return httpx.post(f"{front}/v1/completions", timeout=120, json={
                "model": str(llama_ckpt), "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(generate, prompts, [url, url2] * 3))
        used = set()
        for prompt, r in zip(prompts, answers, strict=True):
            assert r.status_code == 200, r.text
            timings = json.loads(r.headers["x-splitserve-timings"])
            assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
            used |= {timings["prefill"], timings["decode"]}
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, prompt, 8)
        assert used == set(workers)
        whole = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": str(llama_ckpt), "prompt": prompts[0], "max_tokens": 8, "temperature": 0.7,
            "seed": 1, "ignore_eos": True, "n": 2})
        assert whole.status_code == 200 and len(whole.json()["choices"]) == 2
        for front, peer in ((url, url2), (url2, url)):
            assert httpx.get(f"{front}/workers").json()["peers"] == [
                {"url": peer, "counted": True, "last_error": None}]
        # a router that dies is started again on its port; the other serves meanwhile
        second = next(pid for pid, cmd in cmdlines().items()
                      if " router " in cmd and f"--port {port + 1} " in cmd and pid in children)
        os.killpg(second, signal.SIGKILL)
        assert generate(prompts[1]).json()["choices"][0]["token_ids"] == hf_greedy(
            llama_ckpt, prompts[1], 8)
        deadline = time.monotonic() + 60
        while "router1 " + url2 + " exited" not in (tmp_path / "serve.out").read_text():
            assert time.monotonic() < deadline, (tmp_path / "serve.out").read_text()
            time.sleep(0.5)
        while True:
            try:
                if httpx.get(f"{url2}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the restarted router is not healthy"
            time.sleep(0.5)
        assert generate(prompts[2], url2).json()["choices"][0]["token_ids"] == hf_greedy(
            llama_ckpt, prompts[2], 8)
        children |= descendants(proc.pid)
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
        token = tokens.pop()
        assert not any(token in cmd for cmd in cmdlines().values())
        worker_dirs = {Path(line.split("=", 1)[1]) for pid in children
                       for line in environ(pid) if line.startswith("SPLITSERVE_WORKER_DIR=")}
        assert len(worker_dirs) == 2 and all(d.is_dir() for d in worker_dirs)
        # the launcher killed outright (OOM, kill -9): its workers' guards take every
        # process of theirs down, vLLM's engine processes included, and their directories
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        out.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "serve.out").read_text()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.2)
    leftover = {pid: cmd[:120] for pid, cmd in cmdlines().items() if pid in children
                and alive(pid)}
    assert leftover == {}, leftover
    for w in workers:
        try:
            httpx.get(f"{w}/health", timeout=2)
            raise AssertionError(f"{w} still answers after shutdown")
        except httpx.TransportError:
            pass
    assert not any(d.exists() for d in worker_dirs)
    # the YAML's speculative config reached D's engine and not P's
    logs = {f.stem: f.read_text(errors="replace") for f in log_dir.glob("*.log")}
    assert "speculative_config=None" in logs["prefill0"]
    assert "'speculative_config': {'method': 'ngram'" in logs["decode1"]
