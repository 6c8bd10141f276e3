"""Start-up time of a deployment: the local launcher against the Ray backend, same shape, same
model, alternating (local, ray, local, ray, ...). Time from the call to `start()` until the
router answers a request; the Ray backend's own split (cluster up, every replica healthy, router
ready) beside it. Printed and written to JSON, never asserted.

    python benchmarks/ray_startup.py [--model DIR] [--rounds 2] [--prefill 1 --decode 1]

Ray here is a one-node cluster started for the run on 127.0.0.1 (`--ray` without an address),
so its number includes starting Ray itself; on an existing cluster that part is gone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_json  # noqa: E402

from splitserve.launch.config import from_mapping  # noqa: E402
from splitserve.worker.launch import free_port  # noqa: E402


def one(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = from_mapping({"backend": backend, "model": args.model, "prefill": args.prefill,
                        "decode": args.decode, "port": free_port(), "max_model_len": 1024,
                        "stop_timeout_s": 10})
    if backend == "ray":
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        from splitserve.launch.raybackend.deployment import RayDeployment

        dep: Any = RayDeployment(cfg, say=lambda line: None)
    else:
        from splitserve.launch.local import LocalDeployment

        dep = LocalDeployment(cfg, say=lambda line: None)
    t0 = time.monotonic()
    try:
        url = dep.start()
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        r.raise_for_status()
        ready = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        dep.stop()
        stopped = time.monotonic() - t1
    out = {"backend": backend, "ready_s": round(ready, 2), "stop_s": round(stopped, 2)}
    if backend == "ray":
        out.update({f"{k}_s": round(v, 2) for k, v in dep.startup_s.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ray_startup.json"))
    args = ap.parse_args()
    runs = []
    for i in range(args.rounds):
        for backend in ("local", "ray"):
            runs.append(one(backend, args))
            print(f"round {i + 1}: {runs[-1]}", flush=True)
    table = {}
    for backend in ("local", "ray"):
        xs = [r["ready_s"] for r in runs if r["backend"] == backend]
        table[backend] = {"median_ready_s": statistics.median(xs), "runs": xs}
    print(f"\n{'backend':8} {'ready (median)':>15}  runs")
    for backend, row in table.items():
        print(f"{backend:8} {row['median_ready_s']:>13.1f} s  {row['runs']}")
    write_json(args.out, {"shape": f"{args.prefill}P{args.decode}D", "model": args.model,
                          "runs": runs, "summary": table})


if __name__ == "__main__":
    main()
