"""The planner on a case whose best split is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.bench.metrics import SLO
from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec
from splitserve.sim.costmodel import DecodeCost, PrefillCost, TransferLink
from splitserve.sim.planner import PlanRequest, plan, plot_plan
from tests.sim.conftest import make_profile


def test_planner_picks_the_balanced_ratio(tmp_path: Path) -> None:
    """A prompt costs 0.3 s of P time; a request's decode costs ~0.1 s of D time (1 ms per batch
    member per step, 100 steps). With 4 workers P capacity is 3.3 req/s per P, D capacity
    10 req/s per D, so 3P:1D balances (10 req/s both ways) and beats 2P:2D (6.7) and 1P:3D (3.3).
    """
    prof = make_profile(prefill=PrefillCost(0.0, 1e-3, 0.0), decode=DecodeCost(0.0, 0.0, 1e-3),
                        link=TransferLink(1e10, 0.0))
    spec = WorkloadSpec(num_requests=1000, input=LengthDist("fixed", 300),
                        output=LengthDist("fixed", 101), arrival=ArrivalSpec("poisson", 5.0))
    p = plan(prof, spec, PlanRequest(rate=5.0, slo=SLO(2000, 10), workers=4))
    assert p.best.label == "3P:1D"
    by = {c.label: c for c in p.candidates}
    assert set(by) == {"colocated", "chunked", "1P:3D", "2P:2D", "3P:1D"}
    assert by["3P:1D"].goodput > by["2P:2D"].goodput > by["1P:3D"].goodput
    assert by["3P:1D"].goodput < 10.0  # never above the balanced capacity
    assert p.to_dict()["best"] == "3P:1D"
    png = plot_plan(p, tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spec", [
    *(WorkloadSpec(source=source, path="unused.csv")
      for source in ("interference", "trace", "mooncake", "multiturn")),
    WorkloadSpec(arrival=ArrivalSpec("closed", max_concurrency=4))])
def test_planning_refuses_a_workload_whose_request_rate_it_cannot_set(
        spec: WorkloadSpec) -> None:
    """A trace's or Mooncake's timestamps, multiturn's session starts, interference's fixed
    long-prompt period, a closed loop: none is a request rate the planner could sweep."""
    with pytest.raises(ValueError, match="sweeps the request rate"):
        plan(make_profile(), spec, PlanRequest(rate=1.0, slo=SLO(2000, 10), workers=2))


def test_planner_says_dont_split_when_decode_is_free_of_interference() -> None:
    """Tiny prompts and a generous TPOT SLO: a prefill never stalls decodes noticeably, and every
    split strands capacity in one pool, so colocated wins."""
    prof = make_profile(prefill=PrefillCost(0.001, 1e-5, 0.0),
                        decode=DecodeCost(0.01, 0.0, 1e-3))
    spec = WorkloadSpec(num_requests=600, input=LengthDist("fixed", 16),
                        output=LengthDist("fixed", 64), arrival=ArrivalSpec("poisson", 5.0))
    p = plan(prof, spec, PlanRequest(rate=5.0, slo=SLO(1000, 100), workers=4))
    assert p.best.config.mode != "disagg"
