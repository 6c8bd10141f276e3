"""splitserve's connector (tcp, shm) against vLLM's NixlConnector and MooncakeConnector, side by
side: the same model
(the demo model unless --model), the same cores (P on core 0, D on core 1, the router sharing
them), the same request streams, splitserve's router in front of every system.

Each arm is the deployment `splitserve bench compare --deploy NAME=disagg:{tcp,shm,nixl,mooncake}`
starts
(`splitserve.bench.deploy`), and gets, in this order:
- TTFT probes: streamed prompts of each `--lengths` (fresh random ids, `--reps` each, a quiet
  `--gap-s` after each: a worker busy-polls for 0.1-1 s after a step), 8 output tokens:
  TTFT and handover (t1 -> t2) at the client; the transfer's exposed tail: splitserve's
  `kv_tail_s` (the router's timings from D's record: end of P's last layer -> D's ACK), NIXL's
  pull time (`vllm:nixl_xfer_time_seconds` on D, read before and after each probe: probes run
  one at a time, so each delta is one request's transfer; vLLM keeps no per-request record,
  and the whole pull comes after P's leg; Mooncake exports no transfer metric, so "–"); and
  D's wait, the router's `d_queue_s` (D's leg sent -> D's first token: for NIXL the pull plus
  D's one-token recompute; Mooncake's D leg goes out with P's, so its wait holds P's prefill
  too);
- the interference workload (`splitserve bench --workload interference`, seed 0): ITL p50 / p99 /
  max and the interference ratio (splitserve/bench/metrics.py), and, for NIXL, vLLM's transfer
  histograms over the run (the result's `nixl_transfers`).

Arms run one at a time; results merge into --out (so arms can run in separate invocations) and
the table of every arm in it is printed. Timings are reported, never asserted.

    python benchmarks/nixl_side_by_side.py [--arms tcp,shm,nixl,mooncake] [--lengths 256,2048]
        [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import random_prompt, timed_stream, write_json  # noqa: E402

from splitserve.bench.cli import discover_workers  # noqa: E402
from splitserve.bench.client import NIXL_SERIES, ClientConfig, parse_sum  # noqa: E402
from splitserve.bench.deploy import deployment, parse_arm  # noqa: E402
from splitserve.bench.runner import RunOptions, run_bench  # noqa: E402
from splitserve.bench.workload import INTERFERENCE, WorkloadSpec  # noqa: E402
from splitserve.config import bearer_headers  # noqa: E402
from splitserve.hub import ModelSource  # noqa: E402

SPEC = WorkloadSpec(source="interference", interference=INTERFERENCE, seed=0, warmup=2)
ARMS = ("tcp", "shm", "nixl", "mooncake")
LABELS = {"nixl": "NIXL", "mooncake": "Mooncake (tcp)"}
TAIL_KEYS = {"nixl": "nixl_xfer_s", "mooncake": "mooncake_xfer_s"}  # Mooncake's: never set


def nixl_xfer(d: httpx.Client) -> tuple[float, float]:
    """(transfers, seconds) of D's `vllm:nixl_xfer_time_seconds` so far (0, 0 without NIXL)."""
    text = d.get("/metrics").text
    return (parse_sum(text, NIXL_SERIES["count"]) or 0.0,
            parse_sum(text, NIXL_SERIES["xfer_s"]) or 0.0)


def probe(url: str, d_url: str, token: str | None, model: str, lengths: list[int], reps: int,
          gap_s: float) -> dict[str, Any]:
    """Per prompt length: each probe's TTFT, handover and transfer timings (seconds)."""
    out: dict[str, Any] = {}
    with httpx.Client(timeout=300) as client, \
            httpx.Client(base_url=d_url, headers=bearer_headers(token), timeout=30) as d:
        for i in range(2):  # warm-up: the first requests of a fresh pair pay one-off costs
            timed_stream(client, url, {"model": model, "prompt": random_prompt(64, 900 + i, 4000),
                                       "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            time.sleep(gap_s)
        for length in lengths:
            rows = []
            for rep in range(reps):
                before = nixl_xfer(d)
                t = timed_stream(client, url, {
                    "model": model, "prompt": random_prompt(length, 1000 * length + rep, 4000),
                    "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                after = nixl_xfer(d)
                pulls = after[0] - before[0]
                rows.append({"ttft_s": t.ttft, "handover_s": t.gaps[0] if t.gaps else None,
                             "kv_tail_s": t.server.get("kv_tail_s"),
                             "d_queue_s": t.server.get("d_queue_s"),
                             "kv_transfer_s": t.server.get("kv_transfer_s"),
                             "nixl_pulls": pulls,
                             "nixl_xfer_s": (after[1] - before[1]) if pulls else None})
                time.sleep(gap_s)
            out[str(length)] = rows
    return out


def run_arm(name: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    arm = parse_arm(f"{name}=disagg:{name}", (0, 1))
    log_dir = Path(tempfile.mkdtemp(prefix=f"splitserve-nixl-sbs-{name}-"))
    with deployment(ModelSource(model), arm, log_dir) as ep:
        metrics_urls, workers = discover_workers(ep.url)
        d_url = next(u for k, u in metrics_urls.items() if k.startswith("decode"))
        served = httpx.get(f"{ep.url}/v1/models", timeout=30).json()["data"][0]["id"]
        probes = probe(ep.url, d_url, ep.token, served, args.lengths, args.reps, args.gap_s)
        dep = arm.description() | {"url": ep.url, "model_dir": model, "workers": workers} | ep.info
        result = asyncio.run(run_bench(ClientConfig(url=ep.url, run_tag=name), SPEC, name, dep,
                                       metrics_urls, RunOptions(total_cores=2,
                                                                worker_token=ep.token)))
    result.pop("requests", None)  # the raw records stay out of this summary file
    for key in ("input_lens", "output_lens", "ttfts", "itls", "start_times",
                "errors_per_request"):
        result.pop(key, None)
    return {"probes": probes, "interference": result, "logs": str(log_dir)}


def med_ms(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(xs) * 1e3 if xs else None


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def table(results: dict[str, Any], lengths: list[int]) -> str:
    """One row per arm; each probe cell is the median at every length, `a / b`."""
    per = " / ".join(f"{n:,}" for n in lengths)
    head = ["system", f"TTFT {per} (ms)", f"handover t1→t2 {per}",
            f"exposed tail {per}", f"D wait {per}", "ITL p50 / p99 / max",
            "interference p50 / p99", "failed", "load avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in ARMS:
        if name not in results:
            continue
        r = results[name]
        tail_key = TAIL_KEYS.get(name, "kv_tail_s")

        def cell(key: str, digits: int = 1, r: dict[str, Any] = r) -> str:
            return " / ".join(fmt(med_ms(r["probes"].get(str(n), []), key), digits)
                              for n in lengths)

        i = r["interference"]
        load = r.get("loadavg_1m")
        lines.append("| " + " | ".join([
            LABELS.get(name, f"splitserve {name}"), cell("ttft_s", 0),
            cell("handover_s"), cell(tail_key), cell("d_queue_s"),
            f"{fmt(i.get('median_itl_ms'))} / {fmt(i.get('p99_itl_ms'))} / "
            f"{fmt(i.get('max_itl_ms'))}",
            f"{fmt(i.get('itl_interference_p50_ratio'), 2)} / "
            f"{fmt(i.get('itl_interference_p99_ratio'), 2)}",
            f"{i.get('failed')}/{i.get('num_prompts')}",
            "–" if not load else f"{load[0]:.1f} → {load[1]:.1f}"]) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help="of tcp, shm, nixl, mooncake")
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[256, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=1.2)
    ap.add_argument("--out", default="benchmarks/results/nixl_side_by_side.json")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: a list of {', '.join(ARMS)}")
    if args.model is None:
        from splitserve.demo_model import embedded_model_dir

        args.model = str(embedded_model_dir())
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    for name in arms:
        started, load = datetime.now(UTC).isoformat(timespec="seconds"), os.getloadavg()
        results[name] = run_arm(name, args.model, args) | {
            "started": started, "model": args.model,
            # the machine's noise: other processes' load when the arm started and ended
            "loadavg_1m": [load[0], os.getloadavg()[0]]}
        write_json(out, results)
    print(table(results, args.lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
