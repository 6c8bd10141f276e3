"""`sim.drift`: the canary's speed, a drifted profile, and drift-adjusted validation points."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec
from splitserve.sim.deployment import SimConfig
from splitserve.sim.drift import Speed, scaled
from splitserve.sim.model import DecodeCost, SplitCost
from splitserve.sim.validate import METRICS, compare, simulate_point
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile


def _rec(send: float, times: list[float]) -> RequestRecord:
    return RequestRecord(0, "normal", 10, len(times), send, send_s=send, chunk_times=times)


def test_speed_is_median_ttft_and_median_gap_after_t2() -> None:
    recs = [_rec(0.0, [0.10, 0.50, 0.51, 0.52, 0.53]),  # t1 -> t2 (0.4 s) is not a decode gap
            _rec(1.0, [1.12, 1.13, 1.15, 1.17, 1.19]),
            _rec(2.0, [2.11, 2.12, 2.14, 2.16, 2.18])]
    speed = Speed.of(recs)
    assert speed.ttft_s == pytest.approx(0.11)
    assert speed.gap_s == pytest.approx(0.02)  # gaps 0.01 x3, 0.02 x6
    assert speed.drift(Speed(0.055, 0.01)) == pytest.approx((2.0, 2.0))
    assert Speed.mean([Speed(0.1, 0.01), Speed(0.2, 0.03)]) == Speed(pytest.approx(0.15),
                                                                      pytest.approx(0.02))


def test_a_drifted_profile_scales_a_lone_requests_ttft_and_tpot() -> None:
    from splitserve.sim.simulator import simulate

    prof = replace(make_profile(), gap_jitter_s=((-0.001, 500), (0.003, 500)))
    assert scaled(prof, 1.0, 2.0).gap_jitter_s == ((-0.002, 500), (0.006, 500))
    prof = make_profile()
    wl = SimWorkload.of([1.0], [300], [20])
    base = simulate(prof, SimConfig("colocated", n_workers=1), wl)
    slow = simulate(scaled(prof, 2.0, 3.0), SimConfig("colocated", n_workers=1), wl)
    assert slow.first_token[0] - 1.0 == pytest.approx(2.0 * (base.first_token[0] - 1.0))
    assert slow.finish[0] - slow.first_token[0] == pytest.approx(
        3.0 * (base.finish[0] - base.first_token[0]))
    with pytest.raises(ValueError):
        scaled(prof, 0.0, 1.0)


def test_split_costs_drift_with_the_side_they_run_on() -> None:
    split = SplitCost(0.002, 1.1, 0.003, 1e-6, DecodeCost(0.008, 1e-6, 4e-4), cpu_p_s=0.02,
                      cpu_d_s=0.01, p_busy_stretch=0.2, arrive_s=0.001, t1_s=0.004,
                      join_s=0.003, finish_s=0.002, gap_jitter_s=((-0.002, 500), (0.004, 500)),
                      interference=((1.0, 0.1, 0.001, 0.004, 0.003, 0.002),
                                    (4.0, 0.2, 0.002, 0.005, 0.004, 0.003)))
    s = scaled(replace(make_profile(), split=split), 1.5, 2.0).split
    assert s is not None
    assert (s.prefill_factor, s.p_busy_stretch) == (1.1, 0.2)  # ratios stay
    assert s.cpu_p_s == pytest.approx(0.03) and s.cpu_d_s == pytest.approx(0.02)
    assert s.decode.time(2, 1000) == pytest.approx(2.0 * split.decode.time(2, 1000))
    assert s.handover(500) == pytest.approx(2.0 * split.handover(500))
    assert s.events == pytest.approx(tuple(2.0 * e for e in split.events))
    assert s.terms(4.0) == pytest.approx((0.2, 0.004, 0.010, 0.008, 0.006))
    assert [v for v, _ in s.gap_jitter_s] == pytest.approx([-0.004, 0.008])


def test_validation_points_carry_the_drift_adjusted_simulation() -> None:
    prof, cfg = make_profile(), SimConfig("chunked", n_workers=1)
    spec = WorkloadSpec(num_requests=40, input=LengthDist("uniform", 200, 50, 400),
                        output=LengthDist("fixed", 20), arrival=ArrivalSpec("poisson", 1.0))
    ref = Speed(0.1, 0.01)
    slow = simulate_point(scaled(prof, 1.2, 1.3), cfg, spec)
    # three repeats, all measured 20 % / 30 % slower than the reference canary, and exactly as
    # the drifted profile says
    real = {1.0: [{**{m: slow[m] for m in METRICS}, "canary": {"ttft_s": 0.12, "gap_s": 0.013}}
                  for _ in range(3)]}
    (p, *_) = points = compare(prof, cfg, spec, (1.0,), real, ref)
    for p in points:
        adj = p.adjusted
        assert adj is not None and adj.error == pytest.approx(0.0, abs=1e-9)
    tpot = next(p for p in points if p.metric == "median_tpot_ms")
    assert tpot.error < -0.2  # raw: the profile's machine was 30 % faster at decode
    # no reference, or a repeat without its canary: no adjusted simulation
    assert all(p.adjusted is None for p in compare(prof, cfg, spec, (1.0,), real))
    real[1.0][1] = {m: slow[m] for m in METRICS}
    assert all(p.sim_adjusted is None for p in compare(prof, cfg, spec, (1.0,), real, ref))
