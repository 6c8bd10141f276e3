"""`splitserve plan`: colocated or disaggregated, and at which P:D, for a workload, a request
rate, SLOs, a hardware profile and a budget of workers.

Every candidate — colocated (whole prompts), chunked prefill, and each P:D with P + D = budget —
is simulated on the same request stream (the workload spec at the asked rate). For each it
reports SLO attainment at that rate and its DistServe goodput: the highest rate at which at
least `target` (0.9) of requests meet both the TTFT and TPOT SLOs, found by doubling/halving
the rate to bracket the target and bisecting, then interpolating like the benchmark
(`splitserve.bench.metrics.distserve_goodput`). Every rate offers the same stream for the same
duration (`SimWorkload.at_rate`: arrival times scaled by 1/rate, the stream cut or repeated), so a
higher rate is a higher load, never a shorter burst.

The recommendation is the candidate with the highest goodput; ties go to the higher attainment
at the asked rate, then to colocated (fewer moving parts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.bench.metrics import SLO, distserve_goodput
from splitserve.bench.workload import WorkloadSpec
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.results import attainment, summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload, arrays_from_spec, check_open_loop


@dataclass(frozen=True)
class PlanRequest:
    rate: float
    slo: SLO
    workers: int
    target: float = 0.9
    transport: str = "tcp"
    connector: str = "splitserve"  # the P:D candidates' KV connector (SimConfig.connector)
    overlap: bool = True
    pull_request_s: float = 0.0  # nixl: D's leg from its arrival at D to its scheduler
    split_costs: bool = True  # the profile's measured split costs, where they apply
    chunk_budget: int | None = None  # token budget of the chunked baseline (None: profile's)
    bisect_steps: int = 6

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("rate must be positive")
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise ValueError("planning needs both a TTFT and a TPOT SLO")
        if self.workers < 1:
            raise ValueError("the worker budget must be >= 1")
        if not 0 < self.target <= 1:
            raise ValueError("target attainment must be in (0, 1]")


@dataclass(frozen=True)
class Candidate:
    label: str
    config: SimConfig
    attainment: float
    goodput: float | None
    goodput_bound: str
    metrics: dict[str, Any]

    @property
    def goodput_per_worker(self) -> float | None:
        return None if self.goodput is None else self.goodput / self.config.workers


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    candidates: tuple[Candidate, ...]
    best: Candidate

    @property
    def verdict(self) -> str:
        b = self.best
        kind = ("disaggregated " + b.label) if b.config.mode == "disagg" else b.label
        meets = "meets" if b.attainment >= self.request.target else "does NOT meet"
        gp = "none" if b.goodput is None else f"{b.goodput:.3g} req/s"
        return (f"{kind}: {b.attainment:.1%} of requests within SLO at "
                f"{self.request.rate:g} req/s ({meets} the {self.request.target:.0%} target); "
                f"goodput {gp}")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "best": self.best.label,
                "connector": self.request.connector, "transport": self.request.transport,
                "rate": self.request.rate, "workers": self.request.workers,
                "slo": {"ttft_ms": self.request.slo.ttft_ms, "tpot_ms": self.request.slo.tpot_ms},
                "target": self.request.target,
                "candidates": [{"label": c.label, "mode": c.config.mode,
                                "n_prefill": c.config.n_prefill if c.config.mode == "disagg"
                                else None,
                                "n_decode": c.config.n_decode if c.config.mode == "disagg"
                                else None,
                                "attainment": c.attainment, "goodput": c.goodput,
                                "goodput_bound": c.goodput_bound,
                                "goodput_per_worker": c.goodput_per_worker,
                                "metrics": c.metrics} for c in self.candidates]}


def candidate_configs(req: PlanRequest) -> list[tuple[str, SimConfig]]:
    n = req.workers
    out = [("colocated", SimConfig("colocated", n_workers=n)),
           ("chunked", SimConfig("chunked", n_workers=n, token_budget=req.chunk_budget))]
    for p in range(1, n):
        out.append((f"{p}P:{n - p}D", SimConfig(
            "disagg", n_prefill=p, n_decode=n - p, transport=req.transport,
            connector=req.connector, overlap=req.overlap,  # type: ignore[arg-type]
            pull_request_s=req.pull_request_s, split_costs=req.split_costs)))
    return out


def _attain(profile: Profile, workload: SimWorkload, cfg: SimConfig, slo: SLO) -> float:
    o = simulate(profile, cfg, workload)
    assert slo.ttft_ms is not None and slo.tpot_ms is not None
    return attainment(o, slo.ttft_ms / 1000, slo.tpot_ms / 1000)


def goodput(profile: Profile, workload: SimWorkload, cfg: SimConfig, req: PlanRequest,
            at_rate: float) -> dict[str, Any]:
    """DistServe goodput of one candidate, starting the search at `req.rate`, where `workload`
    is offered; every other rate offers it for as long (`SimWorkload.at_rate`)."""
    return search_goodput(
        lambda rate: _attain(profile, workload.at_rate(rate, base=req.rate), cfg, req.slo),
        req.rate, at_rate, req.target, req.bisect_steps)


def search_goodput(attain_at: Callable[[float], float], rate: float, at_rate: float,
                   target: float, bisect_steps: int) -> dict[str, Any]:
    """DistServe goodput (`bench.metrics.distserve_goodput`) of a deployment whose attainment
    at a rate `attain_at` gives, found from `rate` (where it is `at_rate`): doubling or halving
    to bracket `target`, then `bisect_steps` geometric bisections."""
    points = {rate: at_rate}
    lo = hi = rate
    if at_rate >= target:
        for _ in range(12):
            hi *= 2
            points[hi] = attain_at(hi)
            if points[hi] < target:
                break
            lo = hi
        else:
            return distserve_goodput(list(points.items()), target)
    else:
        for _ in range(12):
            lo /= 2
            points[lo] = attain_at(lo)
            if points[lo] >= target:
                break
            hi = lo
        else:
            return distserve_goodput(list(points.items()), target)
    for _ in range(bisect_steps):
        mid = (lo * hi) ** 0.5
        points[mid] = attain_at(mid)
        if points[mid] >= target:
            lo = mid
        else:
            hi = mid
    return distserve_goodput([(lo, points[lo]), (hi, points[hi])], target)


def check_plannable(spec: WorkloadSpec) -> None:
    """ValueError for a workload without a request rate to sweep: a trace's or Mooncake's
    timestamps, multiturn's session starts, interference's fixed long-prompt period, a closed
    loop; and for one the simulator does not replay (`check_open_loop`: a concurrency cap)."""
    if spec.source in ("interference", "trace", "mooncake", "multiturn") or (
            spec.arrival.kind == "closed"):
        what = "closed-loop" if spec.arrival.kind == "closed" else repr(spec.source)
        raise ValueError(f"planning sweeps the request rate, which a {what} workload "
                         "does not have; use a synthetic or sharegpt workload, or plan GPUs "
                         "on it (--gpus)")
    check_open_loop(spec)


def plan(profile: Profile, spec: WorkloadSpec, req: PlanRequest,
         progress: Callable[[], None] | None = None) -> Plan:
    """Simulate every candidate of `candidate_configs(req)` (`progress` is called after each)
    and pick the best by goodput, then attainment (`check_plannable` first)."""
    check_plannable(spec)
    cands = []
    workload = arrays_from_spec(spec.with_rate(req.rate))
    for label, cfg in candidate_configs(req):
        o = simulate(profile, cfg, workload)
        assert req.slo.ttft_ms is not None and req.slo.tpot_ms is not None
        att = attainment(o, req.slo.ttft_ms / 1000, req.slo.tpot_ms / 1000)
        gp = goodput(profile, workload, cfg, req, att)
        res = summarize(o, system=f"sim:{label}", slo=req.slo)
        metrics = {k: res[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                       "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                                       "median_handover_ms", "request_throughput")}
        cands.append(Candidate(label, cfg, att, gp["value"], gp["bound"], metrics))
        if progress is not None:
            progress()
    order = {"colocated": 0, "chunked": 1}

    def rank(c: Candidate) -> tuple[float, float, int]:
        return (c.goodput or 0.0, c.attainment, -order.get(c.label, 2))

    return Plan(req, tuple(cands), max(cands, key=rank))


def print_plan(p: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"P:D plan for {p.request.workers} workers at {p.request.rate:g} req/s "
                    f"(TTFT ≤ {p.request.slo.ttft_ms:g} ms, TPOT ≤ {p.request.slo.tpot_ms:g} ms; "
                    f"P:D over {p.request.connector}, link {p.request.transport})")
    for col in ("config", "attainment", "goodput req/s", "per worker", "p50 TTFT ms",
                "p99 TTFT ms", "p50 TPOT ms", "p99 ITL ms"):
        t.add_column(col, justify="right")

    def f(v: float | None, spec: str = ".3g") -> str:
        return "-" if v is None else format(v, spec)

    for c in p.candidates:
        mark = " *" if c is p.best else ""
        gp = f(c.goodput) + ("+" if c.goodput_bound == "lower" else "")
        t.add_row(c.label + mark, f"{c.attainment:.1%}", gp, f(c.goodput_per_worker),
                  f(c.metrics["median_ttft_ms"], ".1f"), f(c.metrics["p99_ttft_ms"], ".1f"),
                  f(c.metrics["median_tpot_ms"], ".2f"), f(c.metrics["p99_itl_ms"], ".1f"))
    console = Console(width=max(Console().width, 110))
    console.print(t)
    console.print(f"[bold]plan:[/bold] {p.verdict}  (+ = goodput is a lower bound)")


def plot_plan(p: Plan, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c.label for c in p.candidates]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.7 * len(labels) + 2), 6),
                                   sharex=True)
    colors = ["tab:green" if c is p.best else "tab:blue" for c in p.candidates]
    ax1.bar(labels, [c.goodput or 0.0 for c in p.candidates], color=colors)
    ax1.axhline(p.request.rate, color="gray", ls="--", label=f"asked rate {p.request.rate:g}")
    ax1.set_ylabel("goodput (req/s)")
    ax1.legend()
    ax1.set_title(f"{p.request.workers} workers, TTFT ≤ {p.request.slo.ttft_ms:g} ms, "
                  f"TPOT ≤ {p.request.slo.tpot_ms:g} ms (simulated)")
    ax2.bar(labels, [100 * c.attainment for c in p.candidates], color=colors)
    ax2.axhline(100 * p.request.target, color="gray", ls="--")
    ax2.set_ylabel(f"attainment at {p.request.rate:g} req/s (%)")
    ax2.set_ylim(0, 100)
    plt.setp(ax2.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
