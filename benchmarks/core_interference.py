"""What a prefill on one core costs a decode on the other, with no splitserve part involved.

Two plain vLLM workers of the embedded model: one on P's core (`--prefill-cpus`, default 0)
and one on D's (`--decode-cpus`, default 1), with no connector, no router and no KV moving. The
decode worker streams `--streams` requests at a time, each replaced when it ends; the prefill
worker gets the interference workload's long prompts (a fresh 1,800-token prompt, one output
token, every 6 s from 3 s on). The decode streams' inter-token gaps are split as `make demo`
splits them (`splitserve.bench.metrics.split_gaps`: a gap overlapping a long prompt's [send,
first token] is "during"), and the ratios during / outside are printed and written as JSON
(default benchmarks/results/core_interference.json).

This is the floor of 1P+1D's interference ratio on this machine: whatever the two cores share
(caches, memory bandwidth, the frequency governor) shows here, and splitserve cannot remove it.

    flock /tmp/splitserve-heavy.lock python benchmarks/core_interference.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import random_prompt, timed_stream, write_json

from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import split_gaps
from splitserve.common.procs import stop_groups
from splitserve.config import WorkerConfig
from splitserve.demo_model import embedded_model_dir
from splitserve.worker.launch import free_port, start_worker, wait_healthy

VOCAB = 4000


def decode_streams(url: str, model: str, n: int, until: float, seed: int,
                   out: list[RequestRecord]) -> None:
    """`n` concurrent streams (96-token prompt, 128 tokens out), each replaced as it ends."""

    def loop(k: int) -> None:
        with httpx.Client(timeout=300) as client:
            i = 0
            while time.perf_counter() < until:
                body = {"model": model, "prompt": random_prompt(96, seed + 1000 * k + i, VOCAB),
                        "max_tokens": 128, "temperature": 0, "ignore_eos": True}
                t = timed_stream(client, url, body)
                out.append(RequestRecord(k * 10_000 + i, "short", 96, 128, t.sent,
                                         send_s=t.sent, chunk_times=t.chunks))
                i += 1

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(loop, range(n)))


def long_prompts(url: str, model: str, start: float, until: float, period_s: float, seed: int,
                 windows: list[tuple[float, float]]) -> None:
    """One fresh 1,800-token prompt (one output token) every `period_s`, first at period / 2."""
    with httpx.Client(timeout=300) as client:
        k = 0
        while (at := start + period_s * (k + 0.5)) < until:
            time.sleep(max(0.0, at - time.perf_counter()))
            body = {"model": model, "prompt": random_prompt(1800, seed + k, VOCAB),
                    "max_tokens": 1, "temperature": 0}
            t = timed_stream(client, url, body)
            windows.append((t.sent, t.chunks[0]))
            k += 1


def one_round(urls: dict[str, str], model: str, args: argparse.Namespace, seed: int
              ) -> dict[str, Any]:
    records: list[RequestRecord] = []
    windows: list[tuple[float, float]] = []
    start = time.perf_counter()
    until = start + args.duration
    longs = threading.Thread(target=long_prompts, args=(urls["prefill"], model, start, until,
                                                       args.period, seed, windows))
    longs.start()
    decode_streams(urls["decode"], model, args.streams, until, seed + 10_000, records)
    longs.join()
    during, outside = split_gaps(records, sorted(windows))
    row: dict[str, Any] = {"long_prompts": len(windows),
                           "prefill_ms": statistics.median(b - a for a, b in windows) * 1e3}
    for side, gaps in (("during", during), ("outside", outside)):
        arr = np.asarray(gaps) * 1e3
        row[side] = {"count": len(gaps), "p50_ms": float(np.median(arr)),
                     "p99_ms": float(np.percentile(arr, 99))}
    row["p50_ratio"] = row["during"]["p50_ms"] / row["outside"]["p50_ms"]
    row["p99_ratio"] = row["during"]["p99_ms"] / row["outside"]["p99_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds a round")
    ap.add_argument("--period", type=float, default=6.0, help="seconds between long prompts")
    ap.add_argument("--streams", type=int, default=8, help="concurrent decode streams")
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--out", default="benchmarks/results/core_interference.json")
    args = ap.parse_args()
    model = str(embedded_model_dir())
    cfgs = {role: WorkerConfig(model=model, port=free_port(), role=None,
                               cpus=tuple(int(c) for c in cpus.split(",")))
            for role, cpus in (("prefill", args.prefill_cpus), ("decode", args.decode_cpus))}
    procs = {role: start_worker(cfg, None, f"/tmp/core-interference-{role}.log")
             for role, cfg in cfgs.items()}
    rounds: list[dict[str, Any]] = []
    try:
        for role, cfg in cfgs.items():
            wait_healthy(cfg.url, procs[role])
        urls = {role: cfg.url for role, cfg in cfgs.items()}
        served = httpx.get(f"{urls['decode']}/v1/models").json()["data"][0]["id"]
        for r in range(args.rounds):
            row = one_round(urls, served, args, seed=100 * (r + 1))
            rounds.append(row)
            print(f"round {r + 1}: {row['long_prompts']} long prompts (prefill p50 "
                  f"{row['prefill_ms']:.0f} ms); decode ITL during / outside: p50 "
                  f"{row['during']['p50_ms']:.2f} / {row['outside']['p50_ms']:.2f} ms "
                  f"({row['p50_ratio']:.3f}), p99 {row['during']['p99_ms']:.2f} / "
                  f"{row['outside']['p99_ms']:.2f} ms ({row['p99_ratio']:.3f}); "
                  f"{row['during']['count']} / {row['outside']['count']} gaps")
    finally:
        stop_groups(list(procs.values()), 20.0)
    med = {k: statistics.median(r[k] for r in rounds) for k in ("p50_ratio", "p99_ratio")}
    print(f"median of {len(rounds)} rounds: p50 ratio {med['p50_ratio']:.3f}, "
          f"p99 ratio {med['p99_ratio']:.3f}")
    write_json(Path(args.out), {"config": vars(args), "rounds": rounds, "median": med})


if __name__ == "__main__":
    main()
