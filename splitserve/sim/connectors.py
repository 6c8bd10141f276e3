"""`splitserve plan --connector compare`: the same plan over each KV connector, side by side.

Each connector plans with its own link from the profile: splitserve's connector over its
transport (`tcp`, `shm`, ...: pushed layer by layer while P prefills), vLLM's NixlConnector
over the `nixl` link (`splitserve profile --nixl-probe` measures one: pulled by D after P's
prefill, then D replays t1; `SimConfig.connector`). Both run without the profile's split
costs, which are measured through splitserve's connector only, so the two stand on the same
footing. The connectors are compared on their best P:D (highest goodput, then attainment at
the asked rate), whether or not a colocated candidate beats both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from splitserve.bench.workload import WorkloadSpec
from splitserve.sim.costmodel import TransferLink
from splitserve.sim.model import Profile
from splitserve.sim.planner import Candidate, Plan, PlanRequest, plan


@dataclass(frozen=True)
class ConnectorPlan:
    connector: str
    transport: str
    link: TransferLink
    plan: Plan

    @property
    def best_split(self) -> Candidate:
        """The best P:D candidate: highest goodput, then attainment at the asked rate."""
        splits = [c for c in self.plan.candidates if c.config.mode == "disagg"]
        return max(splits, key=lambda c: (c.goodput or 0.0, c.attainment))

    @property
    def name(self) -> str:
        return f"{self.connector} ({self.transport})"


# goodputs this close are level: the planner's bisection steps by ~1.1 % (2^(1/64))
LEVEL_GOODPUT = 0.02
LEVEL_ATTAINMENT = 0.005


def _pct(a: float, b: float) -> str:
    return f"{a / b - 1:+.1%}" if b > 0 else "the other meets the target at no rate tried"


@dataclass(frozen=True)
class Comparison:
    plans: tuple[ConnectorPlan, ...]

    @property
    def ranked(self) -> list[ConnectorPlan]:
        """Best first: by the best P:D's goodput, then its attainment; ties keep the order."""
        return sorted(self.plans, key=lambda cp: (-(cp.best_split.goodput or 0.0),
                                                  -cp.best_split.attainment))

    @property
    def level(self) -> bool:
        """The best P:Ds are level: goodput within `LEVEL_GOODPUT` and attainment within
        `LEVEL_ATTAINMENT`."""
        w, k = self.ranked[0].best_split, self.ranked[1].best_split
        wg, kg = w.goodput or 0.0, k.goodput or 0.0
        close = wg <= kg * (1 + LEVEL_GOODPUT) if kg > 0 else wg == 0.0
        return close and abs(w.attainment - k.attainment) < LEVEL_ATTAINMENT

    @property
    def verdict(self) -> str:
        win, lose = self.ranked[0], self.ranked[1]
        w, k = win.best_split, lose.best_split
        wg, kg = w.goodput or 0.0, k.goodput or 0.0
        hw, hk = w.metrics.get("median_handover_ms"), k.metrics.get("median_handover_ms")
        hand = ("" if hw is None or hk is None else
                f"; median handover t1→t2 {hw:.1f} vs {hk:.1f} ms")
        rate = win.plan.request.rate
        if self.level:
            return (f"{win.name} and {lose.name} are level on this workload: best P:D "
                    f"{w.label} / {k.label}, goodput {wg:.3g} / {kg:.3g} req/s, "
                    f"{w.attainment:.1%} / {k.attainment:.1%} within SLO at {rate:g} "
                    f"req/s{hand}")
        return (f"{win.name} wins: best P:D {w.label}, goodput {wg:.3g} req/s against "
                f"{lose.name}'s {k.label} at {kg:.3g} req/s ({_pct(wg, kg)}); at {rate:g} "
                f"req/s {w.attainment:.1%} vs {k.attainment:.1%} within SLO{hand}")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict,
                "winner": None if self.level else self.ranked[0].connector,
                "connectors": [{"connector": cp.connector, "transport": cp.transport,
                                "link": {"bandwidth_Bps": cp.link.bandwidth_Bps,
                                         "latency_s": cp.link.latency_s,
                                         "source": cp.link.source},
                                "best_split": cp.best_split.label,
                                "plan": cp.plan.to_dict()} for cp in self.plans]}


def compare(profile: Profile, spec: WorkloadSpec, req: PlanRequest,
            links: dict[str, str]) -> Comparison:
    """Plan `req` once per connector in `links` (connector → the profile's transport it uses),
    without split costs. ValueError for fewer than two connectors, or a worker budget with no
    P:D (`req.workers` < 2) to compare them on."""
    if len(links) < 2:
        raise ValueError("comparing connectors needs two of them")
    if req.workers < 2:
        raise ValueError("comparing connectors needs a worker budget >= 2 (a P and a D), "
                         f"got {req.workers}")
    out = []
    for connector, transport in links.items():
        link = profile.link(transport)
        p = plan(profile, spec, replace(req, connector=connector, transport=transport,
                                        split_costs=False))
        out.append(ConnectorPlan(connector, transport, link, p))
    return Comparison(tuple(out))


def print_comparison(c: Comparison) -> None:
    from rich.console import Console
    from rich.table import Table

    req = c.plans[0].plan.request
    t = Table(title=f"connectors for {req.workers} workers at {req.rate:g} req/s "
                    f"(TTFT ≤ {req.slo.ttft_ms:g} ms, TPOT ≤ {req.slo.tpot_ms:g} ms, simulated)")
    t.add_column("config")
    for cp in c.plans:
        for col in ("goodput req/s", "attainment", "p50 TTFT ms", "p50 handover ms"):
            t.add_column(f"{cp.connector}\n{col}", justify="right")

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for i, first in enumerate(c.plans[0].plan.candidates):
        row = [first.label]
        for cp in c.plans:
            cand = cp.plan.candidates[i]
            mark = " *" if cand is cp.best_split else ""
            gp = f(cand.goodput, ".3g") + ("+" if cand.goodput_bound == "lower" else "")
            row += [gp + mark, f"{cand.attainment:.1%}",
                    f(cand.metrics["median_ttft_ms"], ".1f"),
                    f(cand.metrics.get("median_handover_ms"), ".1f")]
        t.add_row(*row)
    console = Console(width=max(Console().width, 130))
    console.print(t)
    for cp in c.plans:
        console.print(f"  {cp.name}: {cp.link.bandwidth_Bps / 1e9:.2f} GB/s + "
                      f"{cp.link.latency_s * 1e3:.3f} ms ({cp.link.source})")
    console.print(f"[bold]connectors:[/bold] {c.verdict}  (* = each connector's best P:D, "
                  "+ = goodput is a lower bound)")
