"""What a worker's step costs whatever shares its core afterwards: vLLM's busy-poll window
against splitserve's (`splitserve/worker/spin.py`).

Two variants, each a fresh plain worker of the demo model on core `--core` (default 0):
- `vllm-default`: `idle_spin_s=None` (vLLM's own 1 s window);
- `splitserve`: the default `WorkerConfig.idle_spin_s`.

Per variant, `--reps` times: a short request (`--tokens` decode steps), then a fixed CPU-bound
loop pinned to the same core, timed `--delay-s` after the answer ("after a step": past
splitserve's window, inside vLLM's) and again after `--quiet-s` seconds with nothing sent
("quiet"), and the worker's CPU seconds over the first `--window-s` seconds after an answer.
The loop's slowdown (after / quiet) is what a P, a router or a client sharing that core pays
after each of the worker's steps. Printed and written to benchmarks/results/busy_poll.json,
never asserted.

    flock /tmp/splitserve-heavy.lock python benchmarks/busy_poll.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import stop, write_json  # noqa: E402
from nixl_idle import group_cpu  # noqa: E402

from splitserve.config import WorkerConfig, bearer_headers, new_token  # noqa: E402
from splitserve.worker.launch import free_port, start_worker, wait_healthy  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {"vllm-default": {"idle_spin_s": None}, "splitserve": {}}
LOOP = 2_000_000  # iterations of the probe loop (~0.1 s on one core here)


def probe_s() -> float:
    """Seconds this process takes for a fixed CPU-bound loop (on its pinned core)."""
    start, x = time.perf_counter(), 0
    for i in range(LOOP):
        x += i
    return time.perf_counter() - start


def answer(client: httpx.Client, url: str, tokens: int, seed: int) -> None:
    r = client.post(f"{url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": f"request {seed}: " + "word " * 40, "max_tokens": tokens,
        "ignore_eos": True, "temperature": 0})
    r.raise_for_status()


def run_variant(name: str, model: str, args: argparse.Namespace, token: str,
                log_dir: Path) -> dict[str, Any]:
    cfg = replace(WorkerConfig(model=model, port=free_port(), cpus=(args.core,),
                               served_model_name="m"), **VARIANTS[name])
    proc = start_worker(cfg, token, str(log_dir / f"busy_poll-{name}.log"))
    after, quiet, ratios, cpu = [], [], [], []
    try:
        wait_healthy(cfg.url, proc, 600, token)
        with httpx.Client(headers=bearer_headers(token)) as client:
            answer(client, cfg.url, args.tokens, 0)  # warm
            for rep in range(args.reps):
                time.sleep(args.quiet_s)
                q = probe_s()
                answer(client, cfg.url, args.tokens, rep + 1)
                time.sleep(args.delay_s)
                a = probe_s()
                quiet.append(q)
                after.append(a)
                ratios.append(a / q)
                time.sleep(args.quiet_s)
                answer(client, cfg.url, args.tokens, 100 + rep)
                before = group_cpu(proc.pid)
                time.sleep(args.window_s)
                cpu.append((group_cpu(proc.pid) - before) / args.window_s)
    finally:
        stop(proc)
    return {"idle_spin_s": cfg.idle_spin_s, "probe_quiet_s": statistics.median(quiet),
            "probe_after_step_s": statistics.median(after),
            "slowdown_after_step": statistics.median(ratios), "slowdowns": ratios,
            "worker_cores_after_answer": statistics.median(cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--core", type=int, default=0, help="the worker's and the probe's core")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=3, help="decode steps a request")
    ap.add_argument("--quiet-s", type=float, default=2.0, help="idle before a quiet probe")
    ap.add_argument("--delay-s", type=float, default=0.2, help="from an answer to its probe")
    ap.add_argument("--window-s", type=float, default=1.0, help="worker CPU window after a step")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/busy_poll.json")
    args = ap.parse_args()
    if args.model is None:
        from splitserve.demo_model import embedded_model_dir

        args.model = str(embedded_model_dir())
    os.sched_setaffinity(0, {args.core})  # the probe shares the worker's core
    log_dir = Path("benchmarks/results/logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    token = new_token()
    results: dict[str, Any] = {"model": args.model, "core": args.core, "reps": args.reps,
                               "delay_s": args.delay_s}
    for name in args.variants.split(","):
        results[name] = r = run_variant(name, args.model, args, token, log_dir)
        print(f"{name:13s} window {r['idle_spin_s']} s: probe after a step "
              f"{r['slowdown_after_step']:.2f}x its quiet time {args.delay_s:g} s after a step "
              f"({r['probe_after_step_s'] * 1e3:.0f} vs {r['probe_quiet_s'] * 1e3:.0f} ms); "
              f"worker {r['worker_cores_after_answer']:.2f} cores over the "
              f"{args.window_s:g} s after an answer", flush=True)
    write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
