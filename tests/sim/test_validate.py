"""`compare`: per-metric, per-rate errors against repeated measurements."""

from __future__ import annotations

import pytest

from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec
from splitserve.sim.deployment import SimConfig
from splitserve.sim.validate import METRICS, compare, handovers, simulate_point
from tests.sim.conftest import make_profile


def test_errors_are_reported_per_metric_and_rate() -> None:
    prof, cfg = make_profile(), SimConfig("chunked", n_workers=1)
    spec = WorkloadSpec(num_requests=50, input=LengthDist("uniform", 200, 50, 400),
                        output=LengthDist("fixed", 20), arrival=ArrivalSpec("poisson", 1.0))
    rates = (1.0, 3.0)
    sims = {r: simulate_point(prof, cfg, spec.with_rate(r)) for r in rates}
    # "measured": the simulation scaled by 0.9, 1.0, 1.1 (three repeats)
    real = {r: [{m: sims[r][m] * f for m in METRICS} for f in (0.9, 1.0, 1.1)] for r in rates}
    real[3.0] = [{m: sims[3.0][m] * f for m in METRICS} for f in (1.9, 2.0, 2.1)]
    points = compare(prof, cfg, spec, rates, real)
    assert {(p.rate, p.metric) for p in points} == {(r, m) for r in rates for m in METRICS}
    for p in points:
        if p.rate == 1.0:
            assert p.error == pytest.approx(0.0, abs=1e-12) and p.within_noise
            assert p.spread == pytest.approx(0.1)
        else:
            assert p.error == pytest.approx(-0.5) and not p.within_noise


def test_handovers_split_by_whether_d_was_decoding_at_t1() -> None:
    stream = [0.0] + [0.02 * k for k in range(1, 51)]  # decodes from t2 = 0.02 to 1.0
    joins_busy = [0.5, 0.53, 0.55]  # t1 while the stream decodes
    joins_idle = [2.0, 2.021, 2.04]  # t1 after every stream ended
    before_t2 = [0.01, 0.05]  # t1 before the stream's t2: D not yet decoding it
    one_token = [3.0]  # no handover at all
    idle, busy = handovers([stream, joins_busy, joins_idle, before_t2, one_token])
    assert busy == [pytest.approx(0.03)]
    assert sorted(idle) == [pytest.approx(0.02), pytest.approx(0.021), pytest.approx(0.04)]
