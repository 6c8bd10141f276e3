"""`splitserve plan --gpus N`: the best deployment of N GPUs for a model, a workload and SLOs,
searched over tensor parallelism per pool (P ≠ D), the P and D counts, and the routing policy;
and, over a ladder of budgets, where disaggregation starts (or stops) paying against colocated.

Candidates of a budget G (every one uses at most G GPUs; `profiles` holds one profile a TP
degree, analytic ones from `analytic.analytic_profile(tp=...)` or a measured TP-1 one):
- colocated: `n` workers of TP `t` with n·t ≤ G, chunked prefill (vLLM's default);
- disaggregated: `n_p` P workers of TP `t_p` and `n_d` D workers of TP `t_d`, each ≥ 1, with
  n_p·t_p + n_d·t_d ≤ G and no GPU left that could be one more D (n_d is the most that fits);
- each disaggregated one with every routing policy asked (they differ only on workloads with
  prefix identity); a colocated pool is routed as the router routes it (`load`: its unsplit
  path knows no token ids).

The search: every candidate is simulated at the asked rate; the `shortlist` best by SLO
attainment (then TTFT p50) per kind (colocated, disaggregated) get their DistServe goodput
searched (`planner.search_goodput`). The plan's choice: one that meets the attainment target at
the asked rate before one that does not, then the highest goodput per GPU, then attainment;
colocated wins ties (fewer moving parts). One workload is built once and run at every rate over
the same duration (`SimWorkload.at_rate`: arrival times scaled, the stream cut or repeated).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, cast

from splitserve.bench.metrics import SLO
from splitserve.routing import COLOCATED_POLICY
from splitserve.sim.analytic import gpus_of
from splitserve.sim.deployment import Policy, SimConfig, SimOutcome
from splitserve.sim.model import Profile
from splitserve.sim.planner import search_goodput
from splitserve.sim.results import attainment, summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload

KEPT = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "prefix_hit_rate", "kv_bytes_moved", "prefill_gpu_s", "failed", "request_throughput")


@dataclass(frozen=True)
class GpuPlanRequest:
    gpus: int
    rate: float
    slo: SLO
    policies: tuple[Policy, ...] = ("cache",)
    target: float = 0.9
    transport: str = "rdma"
    shortlist: int = 3
    bisect_steps: int = 5

    def __post_init__(self) -> None:
        if self.gpus < 1 or not self.rate > 0 or self.shortlist < 1:
            raise ValueError("gpus and shortlist must be >= 1 and the rate positive")
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise ValueError("planning needs both a TTFT and a TPOT SLO")
        if not 0 < self.target <= 1:
            raise ValueError("target attainment must be in (0, 1]")


@dataclass(frozen=True)
class Shape:
    """One candidate deployment: its simulated config and the TP of each pool (D: 0 when
    colocated)."""

    config: SimConfig
    tp_p: int
    tp_d: int = 0

    @property
    def gpus(self) -> int:
        c = self.config
        if c.mode == "disagg":
            return c.n_prefill * self.tp_p + c.n_decode * self.tp_d
        return c.n_workers * self.tp_p

    @property
    def label(self) -> str:
        c = self.config
        if c.mode != "disagg":
            return f"colocated {c.n_workers}x tp{self.tp_p}, {c.p_policy}"
        return f"{c.n_prefill}P tp{self.tp_p} : {c.n_decode}D tp{self.tp_d}, {c.p_policy}"


@dataclass(frozen=True)
class GpuCandidate:
    shape: Shape
    attainment: float
    goodput: float | None = None  # None: not searched (off the shortlist) or none found
    searched: bool = False
    metrics: Mapping[str, Any] | None = None
    # "lower": the target was still met at the highest rate tried (the stream's requests all
    # fit the SLOs even as one burst), so the goodput is at least `goodput`
    goodput_bound: str = "exact"

    @property
    def goodput_per_gpu(self) -> float | None:
        return None if self.goodput is None else self.goodput / self.shape.gpus

    def to_dict(self) -> dict[str, Any]:
        c = self.shape.config
        return {"label": self.shape.label, "mode": c.mode, "gpus": self.shape.gpus,
                "tp_p": self.shape.tp_p, "tp_d": self.shape.tp_d or None,
                "n_prefill": c.n_prefill if c.mode == "disagg" else None,
                "n_decode": c.n_decode if c.mode == "disagg" else None,
                "n_workers": c.n_workers if c.mode != "disagg" else None,
                "policy": c.p_policy, "attainment": self.attainment, "goodput": self.goodput,
                "goodput_bound": self.goodput_bound,
                "goodput_per_gpu": self.goodput_per_gpu, "searched": self.searched,
                "metrics": dict(self.metrics or {})}


def shapes(gpus: int, tps: tuple[int, ...], policies: tuple[Policy, ...],
           transport: str) -> list[Shape]:
    """Every candidate of a budget of `gpus` (see the module docstring)."""
    colocated = cast(Policy, COLOCATED_POLICY)
    out = [Shape(SimConfig("chunked", n_workers=gpus // t, p_policy=colocated), t)
           for t in tps if t <= gpus]
    for policy in policies:
        for tp_p in tps:
            for tp_d in tps:
                for n_p in range(1, gpus // tp_p + 1):
                    n_d = (gpus - n_p * tp_p) // tp_d
                    if n_d < 1:
                        break
                    cfg = SimConfig("disagg", n_prefill=n_p, n_decode=n_d, transport=transport,
                                    p_policy=policy, d_policy=policy)
                    out.append(Shape(cfg, tp_p, tp_d))
    return out


@dataclass(frozen=True)
class GpuPlan:
    request: GpuPlanRequest
    candidates: tuple[GpuCandidate, ...]
    best: GpuCandidate
    best_colocated: GpuCandidate | None
    best_disagg: GpuCandidate | None

    @property
    def verdict(self) -> str:
        b, req = self.best, self.request
        gp = "none" if b.goodput is None else f"{b.goodput:.3g} req/s"
        meets = "meets" if b.attainment >= req.target else "does NOT meet"
        return (f"{b.shape.label} on {b.shape.gpus} of {req.gpus} GPUs: {b.attainment:.1%} "
                f"within SLO at {req.rate:.3g} req/s ({meets} the {req.target:.0%} target); "
                f"goodput {gp}")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "gpus": self.request.gpus, "rate": self.request.rate,
                "slo": {"ttft_ms": self.request.slo.ttft_ms,
                        "tpot_ms": self.request.slo.tpot_ms},
                "target": self.request.target, "best": self.best.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates]}


class GpuPlanner:
    """Plans over `profiles` (TP degree -> one worker's profile) for one workload."""

    def __init__(self, profiles: Mapping[int, Profile], workload: SimWorkload,
                 progress: Callable[[], None] | None = None) -> None:
        if not profiles:
            raise ValueError("no profile fits the model (every TP degree was refused)")
        for tp, prof in profiles.items():
            if gpus_of(prof) != tp:
                raise ValueError(f"the profile given for tp={tp} is one of tp={gpus_of(prof)}")
        self.profiles, self.workload, self.progress = dict(profiles), workload, progress

    def at_rate(self, rate: float) -> SimWorkload:
        """The workload at `rate` requests/s over its own duration (`SimWorkload.at_rate`)."""
        return self.workload.at_rate(rate)

    def outcome(self, shape: Shape, rate: float) -> SimOutcome:
        c = shape.config
        d_prof = self.profiles[shape.tp_d] if c.mode == "disagg" else None
        return simulate(self.profiles[shape.tp_p], c, self.at_rate(rate), d_prof)

    def run(self, shape: Shape, rate: float, slo: SLO) -> dict[str, Any]:
        """One simulated run of `shape` at `rate`: the bench's result keys."""
        return summarize(self.outcome(shape, rate), system=shape.label, slo=slo)

    def attain(self, shape: Shape, rate: float, slo: SLO) -> float:
        assert slo.ttft_ms is not None and slo.tpot_ms is not None
        return attainment(self.outcome(shape, rate), slo.ttft_ms / 1000, slo.tpot_ms / 1000)

    def count(self, req: GpuPlanRequest) -> int:
        """The simulations' first pass: how many candidates a plan of `req` has."""
        return len(shapes(req.gpus, tuple(self.profiles), req.policies, req.transport))

    def plan(self, req: GpuPlanRequest) -> GpuPlan:
        """Every candidate at the asked rate, then goodput for the shortlist (see module)."""
        slo = req.slo
        assert slo.ttft_ms is not None and slo.tpot_ms is not None
        first = []
        for shape in shapes(req.gpus, tuple(self.profiles), req.policies, req.transport):
            res = self.run(shape, req.rate, slo)
            first.append((shape, res))
            if self.progress is not None:
                self.progress()

        def order(item: tuple[Shape, dict[str, Any]]) -> tuple[float, float]:
            att = item[1]["slo_attainment"] if item[1].get("slo_attainment") is not None else 0
            return (-att, item[1]["median_ttft_ms"] or float("inf"))

        cands: list[GpuCandidate] = []
        for kind in ("disagg", "chunked"):
            mine = sorted((x for x in first if x[0].config.mode == kind), key=order)
            for k, (shape, res) in enumerate(mine):
                att = attainment_of(res)
                metrics = {key: res.get(key) for key in KEPT}
                if k >= req.shortlist:
                    cands.append(GpuCandidate(shape, att, metrics=metrics))
                    continue
                gp = search_goodput(partial(self.attain, shape, slo=slo), req.rate, att,
                                    req.target, req.bisect_steps)
                cands.append(GpuCandidate(shape, att, gp["value"], True, metrics,
                                          str(gp.get("bound", "exact"))))
        return finish(req, cands)



def attainment_of(res: Mapping[str, Any]) -> float:
    att = res.get("slo_attainment")
    return float(att) if att is not None else 0.0


def finish(req: GpuPlanRequest, cands: list[GpuCandidate]) -> GpuPlan:
    def rank(c: GpuCandidate) -> tuple[bool, float, float, int]:
        return (c.attainment >= req.target, c.goodput_per_gpu or 0.0, c.attainment,
                int(c.shape.config.mode != "disagg"))

    colocated = [c for c in cands if c.shape.config.mode != "disagg"]
    disagg = [c for c in cands if c.shape.config.mode == "disagg"]
    return GpuPlan(req, tuple(cands), max(cands, key=rank),
                   max(colocated, key=rank) if colocated else None,
                   max(disagg, key=rank) if disagg else None)


@dataclass(frozen=True)
class Rung:
    """One budget of the ladder: its plan's best colocated and best disaggregated candidate."""

    gpus: int
    colocated: GpuCandidate | None
    disagg: GpuCandidate | None

    @property
    def winner(self) -> str:
        """`disaggregated` or `colocated`: more goodput per GPU at this budget; `neither`: no
        candidate meets the SLOs at any rate."""
        pd = self.disagg.goodput_per_gpu if self.disagg else None
        co = self.colocated.goodput_per_gpu if self.colocated else None
        if not pd and not co:
            return "neither"
        return "disaggregated" if pd and (not co or pd > co) else "colocated"


def budgets(gpus: int) -> list[int]:
    """The ladder's budgets: the powers of two below `gpus`, and `gpus`."""
    out, b = [], 1
    while b < gpus:
        out.append(b)
        b *= 2
    return out + [gpus]


def ladder(planner: GpuPlanner, req: GpuPlanRequest, done: GpuPlan | None = None
           ) -> list[Rung]:
    """`planner`'s plan at every budget of `budgets(req.gpus)` that some candidate fits
    (`done`: the plan of `req` itself, already made)."""
    rungs = []
    for b in budgets(req.gpus):
        at = replace(req, gpus=b)
        if not shapes(b, tuple(planner.profiles), at.policies, at.transport):
            continue
        p = done if done is not None and b == req.gpus else planner.plan(at)
        rungs.append(Rung(b, p.best_colocated, p.best_disagg))
    return rungs


def ladder_verdict(rungs: list[Rung]) -> str:
    """Where disaggregation pays, where colocated does, and where neither meets the SLOs."""
    if not rungs:
        return "no budget of the ladder fits the model"
    by: dict[str, list[str]] = {}
    for r in rungs:
        by.setdefault(r.winner, []).append(str(r.gpus))
    parts = []
    if "disaggregated" in by:
        parts.append(f"disaggregation gives the most goodput per GPU at "
                     f"{', '.join(by['disaggregated'])} GPUs")
    if "colocated" in by:
        most = "the most" if parts else "the most goodput per GPU"
        parts.append(f"colocated gives {most} at {', '.join(by['colocated'])} GPUs")
    if "neither" in by:
        parts.append(f"no deployment of {', '.join(by['neither'])} GPUs meets the SLOs at any "
                     "rate")
    return "; ".join(parts)
