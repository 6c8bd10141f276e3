"""The demo: the interference workload on three deployments of the embedded model, side by side.

Arms, at equal total cores (2):
- `colocated`: one plain vLLM worker on 2 cores, token budget covering the longest prompt (a long
  prefill runs in one step: no chunking);
- `colocated-chunked`: one plain vLLM worker on 2 cores with a small token budget (chunked
  prefill);
- `disagg-1p1d`: one prefill and one decode worker, 1 core each, behind splitserve's router,
  started through the launcher.

Each arm's result JSON goes to OUT/<arm>.json, the HTML report to OUT/report.html; the summary
table and a one-line verdict are printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from splitserve.bench.client import ClientConfig
from splitserve.bench.disagg import disagg_deployment, stop_process
from splitserve.bench.report import print_summary, progress_bars, save_result, write_report
from splitserve.bench.runner import RunOptions, run_bench
from splitserve.bench.verdict import demo_verdict
from splitserve.bench.workload import INTERFERENCE, WorkloadSpec
from splitserve.config import WorkerConfig
from splitserve.worker.launch import free_port, start_worker, wait_healthy

DEMO_SPEC = WorkloadSpec(source="interference", interference=INTERFERENCE, seed=0, warmup=2)
SERVED_NAME = "splitserve-demo"
UNCHUNKED_BUDGET = 8192  # covers the longest prompt plus the running batch
CHUNKED_BUDGET = 128


@dataclass(frozen=True)
class Arm:
    """One deployment of the demo."""

    name: str
    kind: str  # "colocated" or "disagg"
    cores: tuple[int, ...]
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("colocated", "disagg"):
            raise ValueError(f"arm kind must be colocated or disagg, got {self.kind!r}")
        if not self.cores:
            raise ValueError("an arm needs at least one core")

    def description(self) -> dict[str, Any]:
        if self.kind == "colocated":
            return {"roles": ["colocated"], "cores_per_worker": [len(self.cores)],
                    "total_cores": len(self.cores), "transport": None,
                    "max_num_batched_tokens": self.max_num_batched_tokens,
                    "chunked_prefill": (self.max_num_batched_tokens or 0)
                    < INTERFERENCE.long_input.high, "router": False}
        return {"roles": ["prefill", "decode"], "cores_per_worker": [1, 1], "total_cores": 2,
                "transport": "shm", "chunked_prefill": False, "router": True}


def demo_arms(cores: tuple[int, ...] = (0, 1)) -> tuple[Arm, ...]:
    return (
        Arm("colocated", "colocated", cores, UNCHUNKED_BUDGET),
        Arm("colocated-chunked", "colocated", cores, CHUNKED_BUDGET),
        Arm("disagg-1p1d", "disagg", cores),
    )


@contextlib.contextmanager
def colocated_worker(model: str, arm: Arm, log_dir: Path) -> Iterator[str]:
    """A plain vLLM worker (no connector) on the arm's cores; yields its URL."""
    cfg = WorkerConfig(model=model, port=free_port(), cpus=arm.cores,
                       max_num_batched_tokens=arm.max_num_batched_tokens,
                       served_model_name=SERVED_NAME)
    proc = start_worker(cfg, None, str(log_dir / f"{arm.name}.log"))
    try:
        wait_healthy(cfg.url, proc, timeout_s=180)
        yield cfg.url
    finally:
        stop_process(proc)


def deployment(model: str, arm: Arm, log_dir: Path) -> contextlib.AbstractContextManager[str]:
    if arm.kind == "colocated":
        return colocated_worker(model, arm, log_dir)
    return disagg_deployment(model, arm.cores, SERVED_NAME, log_dir)


async def _run_arm(url: str, arm: Arm, spec: WorkloadSpec, progress: Any) -> dict[str, Any]:
    from splitserve.bench.cli import discover_workers

    metrics_urls, workers = discover_workers(url)
    client = ClientConfig(url=url, model=SERVED_NAME, run_tag=arm.name)
    dep = arm.description() | {"url": url}
    if workers is not None:
        dep["workers"] = workers
    return await run_bench(client, spec, arm.name, dep, metrics_urls,
                           RunOptions(total_cores=len(arm.cores)), progress)


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
                with deployment(model_dir, arm, log_dir) as url:
                    res = asyncio.run(_run_arm(url, arm, spec, progress))
            except (RuntimeError, TimeoutError, ImportError) as exc:
                skipped[arm.name] = f"{type(exc).__name__}: {exc}"
                continue
            res["run_sheet"]["model"]["model"] = model_dir
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


def quick_spec(duration_s: float) -> WorkloadSpec:
    """The demo workload, shortened (for tests and smoke runs)."""
    return replace(DEMO_SPEC, interference=replace(INTERFERENCE, duration_s=duration_s))
