"""Cost of loading splitserve's connector on requests that do not use it.

Starts two workers on the embedded model pinned to the same cores: plain vLLM (no connector) and
`--role both`. Runs the same batch of requests on each, interleaved A B A B (only one is busy at a
time), and reports output tokens/s per run and the median ratio both/plain. Writes JSON (default
benchmarks/results/connector_overhead.json). Timings are reported, never asserted.

    python benchmarks/connector_overhead.py [--rounds 3] [--concurrency 8] [--cpus 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from splitserve.config import WorkerConfig, new_token
from splitserve.demo_model import embedded_model_dir
from splitserve.worker.launch import free_port, start_worker, wait_healthy


def run_batch(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second for the batch, all requests sent at once."""

    def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cpus", default="0")
    ap.add_argument("--out", default="benchmarks/results/connector_overhead.json")
    args = ap.parse_args()
    cpus = tuple(int(c) for c in args.cpus.split(","))
    model = str(embedded_model_dir())
    token = new_token()
    cfgs = {
        "plain": WorkerConfig(model=model, port=free_port(), role=None, cpus=cpus),
        "both": WorkerConfig(model=model, port=free_port(), role="both", cpus=cpus,
                             kv_port=free_port()),
    }
    procs = {name: start_worker(cfg, token, f"/tmp/overhead-{name}.log")
             for name, cfg in cfgs.items()}
    try:
        for name, cfg in cfgs.items():
            wait_healthy(cfg.url, procs[name])
        served = {n: httpx.get(f"{c.url}/v1/models").json()["data"][0]["id"]
                  for n, c in cfgs.items()}
        prompts = [[5 + (i * 7 + j * 13) % 4000 for j in range(args.prompt_tokens)]
                   for i in range(args.concurrency)]
        for name, cfg in cfgs.items():  # warm-up, untimed
            run_batch(cfg.url, served[name], prompts, 8)
        runs: dict[str, list[float]] = {"plain": [], "both": []}
        for r in range(args.rounds):
            for name in ("plain", "both"):
                tps = run_batch(cfgs[name].url, served[name], prompts, args.max_tokens)
                runs[name].append(tps)
                print(f"round {r + 1} {name:>5}: {tps:8.1f} output tokens/s")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
    ratio = statistics.median(runs["both"]) / statistics.median(runs["plain"])
    print(f"median output tokens/s: plain {statistics.median(runs['plain']):.1f}, "
          f"both {statistics.median(runs['both']):.1f}, ratio both/plain {ratio:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, "ratio_median": ratio, "cpus": cpus,
                               "concurrency": args.concurrency,
                               "prompt_tokens": args.prompt_tokens,
                               "max_tokens": args.max_tokens}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
