"""Chaos at scale: waves of streamed requests through 2P+2D while the spare P and D crash (crash
points and SIGKILL, mid-prefill and mid-stream) and restart, transfers are corrupted, dropped,
cut short and delayed, and clients hang up.

Prints and writes (benchmarks/results/chaos.json): requests sent, completed, explicit errors,
cancelled by the client, lost (must be 0), wrong outputs (must be 0, checked token for token
against transformers in float32) and leaked KV blocks and staged bytes after the drain (must
be 0). The test-sized version is tests/router/test_chaos.py.

    python benchmarks/chaos.py [--waves 4] [--requests 48] [--max-tokens 32] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench.chaos import Outcome, chaos_requests, run_wave, summarize
from splitserve.config import TOKEN_ENV, WorkerConfig, bearer_headers, new_token
from splitserve.worker.launch import free_port, start_worker, wait_healthy

RESULTS = Path(__file__).parent / "results"


class Cluster:
    """2P+2D and a router on loopback; `spares` (P2, D2) may be killed and restarted."""

    def __init__(self, model: str, logs: Path) -> None:
        self.token, self.logs = new_token(), logs
        def worker(role: str, cpu: int, **kw: Any) -> WorkerConfig:
            return WorkerConfig(model=model, port=free_port(), role=role,  # type: ignore[arg-type]
                                kv_port=free_port(), cpus=(cpu,), max_model_len=4096,
                                staging_bytes=256 * 2**20, **kw)

        self.cfgs = {"p1": worker("prefill", 0, max_num_batched_tokens=256),
                     "p2": worker("prefill", 0, max_num_batched_tokens=256),
                     "d1": worker("decode", 1, load_timeout_s=3.0),
                     "d2": worker("decode", 1, load_timeout_s=3.0)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.router: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{free_port()}"

    def spawn(self, name: str) -> None:
        # test faults on every worker; crash points only on the spares
        os.environ["SPLITSERVE_FAULTS"] = "1,crash" if name.endswith("2") else "1"
        self.procs[name] = start_worker(self.cfgs[name], self.token,
                                        str(self.logs / f"{name}.log"))

    def start(self, *names: str) -> None:
        for name in names:
            self.spawn(name)
        for name in names:
            wait_healthy(self.cfgs[name].url, self.procs[name], 600, self.token)

    def start_all(self) -> None:
        self.start(*self.cfgs)
        urls = {n: c.url for n, c in self.cfgs.items()}
        port = self.url.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "splitserve.cli", "router", "--port", port,
                "--prefill", urls["p1"], urls["p2"], "--decode", urls["d1"], urls["d2"],
                "--health-interval", "0.5", "--unhealthy-after", "1", "--healthy-after", "1",
                "--prefill-retries", "3", "--decode-retries", "3", "--log-level", "warning"]
        with open(self.logs / "router.log", "ab") as out:
            self.router = subprocess.Popen(argv, env=os.environ | {TOKEN_ENV: self.token},
                                           stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        wait_healthy(self.url, self.router, 120)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def kill(self, name: str) -> None:
        if self.alive(name):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
            self.procs[name].wait(10)

    def inflight(self) -> dict[str, int]:
        workers = httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
        by_url = {w["url"]: w["inflight"] for w in workers}
        return {n: by_url.get(c.url, 0) for n, c in self.cfgs.items()}

    def leaks(self) -> dict[str, dict[str, float]]:
        """Per worker: KV blocks in use and staged bytes (both 0 when drained)."""
        out = {}
        headers = bearer_headers(self.token)
        for name, cfg in self.cfgs.items():
            state = httpx.get(f"{cfg.url}/splitserve/state", headers=headers, timeout=5).json()
            text = httpx.get(f"{cfg.url}/metrics", headers=headers, timeout=5).text
            usage = blocks = 0.0
            for line in text.splitlines():
                if line.startswith("vllm:kv_cache_usage_perc"):
                    usage = float(line.rsplit(" ", 1)[1])
                if line.startswith("vllm:cache_config_info"):
                    blocks = float(line.split('num_gpu_blocks="')[1].split('"')[0])
            out[name] = {"kv_blocks": round(usage * blocks), "staged_bytes": state["staged_bytes"],
                         "pending_loads": state["pending_loads"],
                         "held_sends": state["held_sends"]}
        return out

    def stop(self) -> None:
        for proc in [self.router, *self.procs.values()]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [self.router, *self.procs.values()]:
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def chaos_monkey(cluster: Cluster, victims: list[str], stop: threading.Event) -> None:
    """Kill each victim once the router has legs open on it (unless a crash point did)."""
    while victims and not stop.is_set():
        load = cluster.inflight()
        for name in list(victims):
            if not cluster.alive(name):
                victims.remove(name)
            elif load[name] > 0:
                time.sleep(0.3 if name.startswith("d") else 0.0)
                cluster.kill(name)
                victims.remove(name)
        time.sleep(0.05)


def hf_reference(model_dir: str, prompts: dict[str, list[int]], max_tokens: int
                 ) -> dict[str, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs: dict[str, list[int]] = {}
    with torch.no_grad():  # greedy, no stop on EOS (the requests set ignore_eos)
        for rid, prompt in prompts.items():
            res, out = model(torch.tensor([prompt]), use_cache=True), []
            for _ in range(max_tokens):
                out.append(int(res.logits[0, -1].argmax()))
                res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values,
                            use_cache=True)
            refs[rid] = out
    return refs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48, help="requests per wave")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="model directory (default: embedded)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model is None:
        from splitserve.demo_model import embedded_model_dir

        args.model = str(embedded_model_dir())
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix="splitserve-chaos-"))
    cluster = Cluster(args.model, logs)
    outcomes: list[Outcome] = []
    prompts: dict[str, list[int]] = {}
    kills = 0
    t0 = time.monotonic()
    try:
        cluster.start_all()
        for wave in range(args.waves):
            reqs = chaos_requests(f"c{wave}", args.requests, rng, 4003, 1200)
            prompts |= {r.rid: r.prompt for r in reqs}
            dead = [n for n in ("p2", "d2") if not cluster.alive(n)]
            restart = threading.Thread(target=cluster.start, args=dead)
            restart.start()  # the dead come back while this wave runs on the survivors
            stop = threading.Event()
            victims = [n for n in ("p2", "d2") if n not in dead and rng.random() < 0.75]
            monkey = threading.Thread(target=chaos_monkey, args=(cluster, victims, stop))
            monkey.start()
            before = {n: cluster.alive(n) for n in ("p2", "d2")}
            outcomes += run_wave(cluster.url, reqs, args.max_tokens)
            stop.set()
            monkey.join()
            restart.join()
            kills += sum(before[n] and not cluster.alive(n) for n in before)
            print(f"wave {wave}: {len(reqs)} requests, spares alive "
                  f"{[n for n in ('p2', 'd2') if cluster.alive(n)]}", flush=True)
        cluster.start(*(n for n in ("p2", "d2") if not cluster.alive(n)))
        deadline = time.monotonic() + 60
        leaks = cluster.leaks()
        while time.monotonic() < deadline and any(any(v.values()) for v in leaks.values()):
            time.sleep(0.5)
            leaks = cluster.leaks()
    finally:
        cluster.stop()
    wall = time.monotonic() - t0
    summary = summarize(outcomes, hf_reference(args.model, prompts, args.max_tokens))
    leaked_blocks = sum(v["kv_blocks"] for v in leaks.values())
    staged = sum(v["staged_bytes"] for v in leaks.values())
    result = {k: summary[k] for k in ("sent", "complete", "error", "cancelled", "lost", "wrong")}
    result |= {"worker_kills": kills, "leaked_kv_blocks": leaked_blocks,
               "leaked_staged_bytes": staged, "leaks_by_worker": leaks, "wall_s": round(wall, 1),
               "waves": args.waves, "max_tokens": args.max_tokens, "seed": args.seed,
               "bad": summary["bad"], "errors": summary["errors"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps(result, indent=2))
    print(f"sent {result['sent']}  completed {result['complete']}  explicit errors "
          f"{result['error']}  cancelled by client {result['cancelled']}  lost {result['lost']}"
          f"  wrong {result['wrong']}  leaked KV blocks {leaked_blocks}  staged bytes {staged}"
          f"  (worker kills {kills}, {wall:.0f} s; logs {logs})")
    ok = result["lost"] == 0 and result["wrong"] == 0 and leaked_blocks == 0 and staged == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
