"""The demo: the interference workload on three deployments of the embedded model, side by side.

Arms, at equal total cores (2):
- `colocated`: one plain vLLM worker on 2 cores, token budget covering the longest prompt (a long
  prefill runs in one step: no chunking);
- `colocated-chunked`: one plain vLLM worker on 2 cores with a small token budget (chunked
  prefill);
- `disagg-1p1d`: one prefill and one decode worker, 1 core each, behind splitserve's router,
  started through the launcher (`splitserve.launch.local`; the router shares the two cores).

Each arm's result JSON goes to OUT/<arm>.json, the HTML report to OUT/report.html; the summary
table and a one-line verdict are printed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

from splitserve.bench.client import ClientConfig
from splitserve.bench.deploy import Arm, Endpoint, deployment
from splitserve.bench.report import print_summary, progress_bars, save_result, write_report
from splitserve.bench.runner import RunOptions, run_bench
from splitserve.bench.runsheet import model_info
from splitserve.bench.verdict import demo_verdict
from splitserve.bench.workload import INTERFERENCE, WorkloadSpec, build_stream
from splitserve.hub import ModelSource

DEMO_SPEC = WorkloadSpec(source="interference", interference=INTERFERENCE, seed=0, warmup=2)
UNCHUNKED_BUDGET = 8192  # covers the longest prompt plus the running batch
CHUNKED_BUDGET = 128


def demo_arms(cores: tuple[int, ...] = (0, 1)) -> tuple[Arm, ...]:
    return (
        Arm("colocated", "colocated", cores, UNCHUNKED_BUDGET),
        Arm("colocated-chunked", "colocated", cores, CHUNKED_BUDGET),
        Arm("disagg-1p1d", "disagg", cores),
    )


async def _run_arm(ep: Endpoint, arm: Arm, spec: WorkloadSpec, progress: Any
                   ) -> dict[str, Any]:
    from splitserve.bench.cli import discover_workers

    url = ep.url
    metrics_urls, workers = discover_workers(url)
    client = ClientConfig(url=url, run_tag=arm.name)
    longest = max(r.input_len for r in build_stream(spec))
    dep = arm.description(longest) | {"url": url} | ep.info
    if workers is not None:
        dep["workers"] = workers
    return await run_bench(client, spec, arm.name, dep, metrics_urls,
                           RunOptions(total_cores=len(arm.cores), worker_token=ep.token),
                           progress)


def run_demo(out_dir: str | os.PathLike[str] = "demo-results",
             spec: WorkloadSpec = DEMO_SPEC, arms: tuple[Arm, ...] | None = None,
             model: str | None = None) -> dict[str, dict[str, Any]]:
    """Run every arm on the same stream; write JSONs + report; print the table and verdict."""
    from splitserve.demo_model import embedded_model_dir

    model_dir = model or str(embedded_model_dir())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="splitserve-demo-logs-"))
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    with progress_bars() as progress:
        for arm in arms or demo_arms():
            try:
                with deployment(ModelSource(model_dir), arm, log_dir) as ep:
                    res = asyncio.run(_run_arm(ep, arm, spec, progress))
            except (RuntimeError, TimeoutError, ImportError) as exc:
                skipped[arm.name] = f"{type(exc).__name__}: {exc}"
                continue
            res["run_sheet"]["model"] = model_info(model_dir) | {
                "served_name": res["run_sheet"]["model"]["model"]}
            results[arm.name] = res
            save_result(res, out / f"{arm.name}.json")
    line = _verdict(results, skipped)
    if results:
        write_report(results, out, line)
        print_summary(results)
    for name, why in skipped.items():
        print(f"{name}: not run ({why}); worker logs in {log_dir}")
    print(line)
    return results


def _verdict(results: dict[str, dict[str, Any]], skipped: dict[str, str]) -> str:
    un, ch = results.get("colocated"), results.get("colocated-chunked")
    if un is None or ch is None:
        return "VERDICT: no comparison — a colocated baseline did not run: " + "; ".join(
            f"{k}: {v}" for k, v in skipped.items())
    return demo_verdict(un, ch, results.get("disagg-1p1d"))
