"""How fast the simulator runs: N requests on a simulated cluster of W workers, on one core.

Target: 1,000,000 requests on 1,000 workers in under 60 s. Prints a table and writes JSON
(default benchmarks/results/sim_speed.json). Timings are reported, never asserted.

    .venv/bin/python benchmarks/sim_speed.py                      # the target case
    .venv/bin/python benchmarks/sim_speed.py --requests 100000    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from splitserve.sim.costmodel import DecodeCost, PrefillCost, TransferLink
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Engine, ModelShape, Profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload

# Step costs of the embedded demo model's order of magnitude (one CPU core).
PROFILE = Profile(
    kind="analytic", engine=Engine("vllm", "0.32.0"),
    model=ModelShape("demo-like", layers=8, kv_heads=2, head_dim=64, dtype_bytes=4),
    hardware={"name": "constructed for the speed benchmark"},
    prefill=PrefillCost(0.01, 5e-4, 2e-8), decode=DecodeCost(0.007, 2e-7, 3e-4),
    token_budget=2048, kv_capacity_tokens=200_000,
    transfer={"tcp": TransferLink(1e9, 5e-4)},
)


def workload(n: int, workers: int, seed: int) -> SimWorkload:
    """Prompts 100-1,000 tokens, outputs 50-250, Poisson at ~70 % of the P pool's capacity."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 1001, size=n)
    outputs = rng.integers(50, 251, size=n)
    mean_prefill = PROFILE.prefill.whole(int(prompts.mean()))
    rate = 0.7 * (workers / 2) / mean_prefill
    return SimWorkload(np.cumsum(rng.exponential(1.0 / rate, size=n)), prompts, outputs)


def run_case(mode: str, n: int, workers: int, seed: int) -> dict[str, object]:
    t0 = time.perf_counter()
    wl = workload(n, workers, seed)
    t_wl = time.perf_counter() - t0
    cfg = (SimConfig("disagg", n_prefill=workers // 2, n_decode=workers - workers // 2)
           if mode == "disagg" else SimConfig(mode, n_workers=workers))
    c0, t1 = time.process_time(), time.perf_counter()
    out = simulate(PROFILE, cfg, wl)
    t_sim, c_sim = time.perf_counter() - t1, time.process_time() - c0
    t2 = time.perf_counter()
    res = summarize(out)
    t_sum = time.perf_counter() - t2
    return {"mode": mode, "requests": n, "workers": workers, "events": out.events,
            "decode_segments": int(len(out.seg_k)), "workload_s": t_wl, "simulate_s": t_sim,
            "simulate_cpu_s": c_sim, "summarize_s": t_sum, "total_s": t_wl + t_sim + t_sum,
            "events_per_s": out.events / t_sim, "simulated_duration_s": res["duration"],
            "completed": res["completed"], "median_ttft_ms": res["median_ttft_ms"],
            "p99_itl_ms": res["p99_itl_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--modes", default="disagg,chunked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/sim_speed.json")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):  # one core, as the target says
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rows = []
    for mode in args.modes.split(","):
        row = run_case(mode, args.requests, args.workers, args.seed)
        rows.append(row)
        print(f"{mode:>9}: {row['requests']:,} requests on {row['workers']} workers: "
              f"simulate {row['simulate_s']:.1f} s, summarize {row['summarize_s']:.1f} s, "
              f"total {row['total_s']:.1f} s ({row['events']:,} events, "
              f"{row['events_per_s']:,.0f}/s); simulated {row['simulated_duration_s']:.0f} s, "
              f"median TTFT {row['median_ttft_ms']:.0f} ms, p99 ITL {row['p99_itl_ms']:.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"target": "1e6 requests, 1000 workers, < 60 s, one core",
                               "python": platform.python_version(),
                               "machine": platform.processor() or platform.machine(),
                               "cases": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
