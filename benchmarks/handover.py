"""TTFT and handover at no load: 1P1D through splitserve's router vs. a colocated worker reached
directly and pinned to the same cores as the P-worker, for prompts of 256-4,096 tokens.

Target: disaggregated TTFT <= colocated TTFT x 1.05 + 2 ms. Handover = t1 at the client -> t2
at the client. Timings are printed and written to JSON, never asserted.

    python benchmarks/handover.py [--model DIR] [--lengths 256,1024,4096] [--reps 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import StreamTiming, summary, timed_stream, write_json  # noqa: E402

from splitserve.config import WorkerConfig  # noqa: E402
from splitserve.launch.config import DeploymentConfig  # noqa: E402
from splitserve.launch.local import LocalDeployment  # noqa: E402
from splitserve.worker.launch import free_port, start_worker, wait_healthy  # noqa: E402


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(length)]


def run(url: str, model: str, lengths: list[int], reps: int, vocab: int, seed_base: int,
        max_tokens: int) -> dict[int, list[StreamTiming]]:
    out: dict[int, list[StreamTiming]] = {}
    with httpx.Client(timeout=300) as client:
        timed_stream(client, url, {"model": model, "prompt": prompt(64, seed_base - 1, vocab),
                                   "max_tokens": 2, "temperature": 0})  # warm-up
        for length in lengths:
            out[length] = []
            for rep in range(reps):
                # a fresh prompt every time: no prefix-cache hit on either side
                body = {"model": model, "prompt": prompt(length, seed_base + 1000 * length + rep,
                                                         vocab),
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                out[length].append(timed_stream(client, url, body))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--transport", choices=("tcp", "shm"), default="tcp")
    ap.add_argument("--out", default="benchmarks/results/handover.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    dep = LocalDeployment(DeploymentConfig(prefill=1, decode=1, model=args.model,
                                           transport=args.transport, port=free_port(),
                                           log_dir=f"/tmp/splitserve-handover-{time.time():.0f}"))
    dep.start()
    colocated = None
    try:
        model = httpx.get(f"{dep.url}/v1/models").json()["data"][0]["id"]
        vocab = int(__import__("json").loads(
            (Path(dep.model_dir) / "config.json").read_text())["vocab_size"])
        p_cfg = dep.workers[0]
        disagg = run(dep.url, model, lengths, args.reps, vocab, 1, args.max_tokens)
        # the baseline: one plain worker on exactly the P-worker's cores, reached directly
        ccfg = WorkerConfig(model=dep.model_dir, port=free_port(), cpus=p_cfg.cpus,
                            dtype=p_cfg.dtype, max_model_len=p_cfg.max_model_len,
                            served_model_name=p_cfg.served_model_name)
        colocated = start_worker(ccfg, None, str(dep.log_dir / "colocated.log"))
        wait_healthy(ccfg.url, colocated)
        coloc = run(ccfg.url, model, lengths, args.reps, vocab, 2, args.max_tokens)
    finally:
        if colocated is not None:
            colocated.terminate()
            colocated.wait(30)
        dep.stop()

    rows: list[dict[str, Any]] = []
    print(f"{'prompt':>7} {'TTFT 1P1D':>10} {'TTFT coloc':>11} {'target':>8} {'met':>4} "
          f"{'handover':>9} {'coloc ITL1':>11} {'P leg':>7} {'KV ms':>7} {'KV MB':>7}")
    for length in lengths:
        d, c = disagg[length], coloc[length]
        ttft_d = statistics.median(t.ttft for t in d) * 1e3
        ttft_c = statistics.median(t.ttft for t in c) * 1e3
        target = ttft_c * 1.05 + 2.0
        kv_ms = [t.server["kv_transfer_s"] * 1e3 for t in d
                 if isinstance(t.server.get("kv_transfer_s"), int | float)]
        kv_mb = [t.server["kv_bytes"] / 1e6 for t in d
                 if isinstance(t.server.get("kv_bytes"), int | float)]
        row = {
            "prompt_tokens": length, "ttft_1p1d_ms": summary([t.ttft for t in d]),
            "ttft_colocated_ms": summary([t.ttft for t in c]),
            "target_ms": target, "target_met": ttft_d <= target,
            "handover_1p1d_ms": summary([t.gaps[0] for t in d if t.gaps]),
            "first_itl_colocated_ms": summary([t.gaps[0] for t in c if t.gaps]),
            "p_leg_ms": summary([t.server["p_leg_s"] for t in d if t.server.get("p_leg_s")]),
            "kv_transfer_ms_median": statistics.median(kv_ms) if kv_ms else None,
            "kv_mb_median": statistics.median(kv_mb) if kv_mb else None,
            "kv_status": sorted({str(t.server.get("kv_status")) for t in d}),
        }
        rows.append(row)
        print(f"{length:>7} {ttft_d:>10.1f} {ttft_c:>11.1f} {target:>8.1f} "
              f"{'yes' if row['target_met'] else 'NO':>4} "
              f"{row['handover_1p1d_ms'].get('median_ms', float('nan')):>9.1f} "
              f"{row['first_itl_colocated_ms'].get('median_ms', float('nan')):>11.1f} "
              f"{row['p_leg_ms'].get('median_ms', float('nan')):>7.1f} "
              f"{row['kv_transfer_ms_median'] or float('nan'):>7.1f} "
              f"{row['kv_mb_median'] or float('nan'):>7.2f}")
    write_json(Path(args.out), {
        "benchmark": "handover", "model": args.model, "transport": args.transport,
        "reps": args.reps, "max_tokens": args.max_tokens, "core_plan": dep.core_note,
        "prefill_cpus": list(p_cfg.cpus or ()), "rows": rows,
        "target": "disaggregated TTFT <= colocated TTFT x 1.05 + 2 ms (medians)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
