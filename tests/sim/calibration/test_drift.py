"""`sim.calibration.drift`: the canary's speed, a drifted profile, and drift-adjusted
validation points."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec
from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.calibration.drift import Canary, Drift, Speed, scaled
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
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
    drift = speed.drift(Speed(0.055, 0.01))
    assert (drift.prefill, drift.decode) == pytest.approx((2.0, 2.0))
    assert drift.stretch == 1.0  # no stretch reading on either side
    assert Speed.mean([Speed(0.1, 0.01), Speed(0.2, 0.03)]) == Speed(pytest.approx(0.15),
                                                                      pytest.approx(0.02))


def test_a_drifted_profile_scales_a_lone_requests_ttft_and_tpot() -> None:
    from splitserve.sim.run import simulate

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
    split = SplitCost(0.002, 1.1, 0.003, 1e-6, DecodeCost(0.008, 1e-6, 4e-4),
                      p_busy_stretch=0.2, arrive_s=0.001, t1_s=0.004,
                      join_s=0.003, finish_s=0.002, t2_s=0.001,
                      gap_jitter_s=((-0.002, 500), (0.004, 500)),
                      interference=((1.0, 0.1, 0.001, 0.004, 0.003, 0.002, 0.001),
                                    (4.0, 0.2, 0.002, 0.005, 0.004, 0.003, 0.0015)))
    s = scaled(replace(make_profile(), split=split), 1.5, 2.0).split
    assert s is not None
    assert (s.prefill_factor, s.p_busy_stretch) == (1.1, 0.2)  # ratios stay
    assert s.decode.time(2, 1000) == pytest.approx(2.0 * split.decode.time(2, 1000))
    assert s.handover(500) == pytest.approx(2.0 * split.handover(500))
    assert s.events == pytest.approx(tuple(2.0 * e for e in split.events))
    assert s.terms(4.0) == pytest.approx((0.2, 0.004, 0.010, 0.008, 0.006, 0.003))
    assert [v for v, _ in s.gap_jitter_s] == pytest.approx([-0.004, 0.008])


def test_validation_points_carry_the_drift_adjusted_simulation() -> None:
    prof, cfg = make_profile(), SimConfig("chunked", n_workers=1)
    spec = WorkloadSpec(num_requests=40, input=LengthDist("uniform", 200, 50, 400),
                        output=LengthDist("fixed", 20), arrival=ArrivalSpec("poisson", 1.0))
    ref = Speed(0.1, 0.01)
    slow = simulate_point(scaled(prof, 1.2, 1.3), cfg, spec)
    # three repeats, all measured 20 % / 30 % slower than the reference canary, and exactly as
    # the drifted profile says
    canary = {"ttft_s": 0.12, "gap_s": 0.013, "stretch": None}
    real = {1.0: [{**{m: slow[m] for m in METRICS}, "canary": canary, "canary_after": canary}
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


SPLIT = SplitCost(0.002, 1.1, 0.003, 1e-6, DecodeCost(0.008, 1e-6, 4e-4),
                  p_busy_stretch=0.2, arrive_s=0.001, t1_s=0.004, join_s=0.003,
                  finish_s=0.002, gap_jitter_s=((-0.002, 500), (0.004, 500)),
                  interference=((1.0, 0.2, 0.001, 0.004, 0.003, 0.002, 0.0),
                                (4.0, 0.05, 0.002, 0.005, 0.004, 0.003, 0.0)))


def test_drift_carries_the_stretch_factor_ratio() -> None:
    now, ref = Speed(0.1, 0.01, 1.32), Speed(0.1, 0.01, 1.1)
    assert now.drift(ref) == Drift(1.0, 1.0, pytest.approx(1.2))
    assert now.drift(Speed(0.1, 0.01)).stretch == 1.0  # reference without a stretch reading
    assert Speed(0.1, 0.01).drift(ref).stretch == 1.0
    mean = Speed.mean([Speed(0.1, 0.01, 1.1), Speed(0.2, 0.03), Speed(0.3, 0.02, 1.3)])
    assert mean.stretch == pytest.approx(1.2)  # over the canaries that read one
    assert Speed.mean([Speed(0.1, 0.01), Speed(0.2, 0.03)]).stretch is None


def test_a_stretch_ratio_scales_exactly_the_p_busy_stretch_terms() -> None:
    prof = replace(make_profile(), split=SPLIT, gap_jitter_s=((-0.001, 500), (0.003, 500)))
    got = scaled(prof, 1.0, 1.0, 1.1)
    s = got.split
    assert s is not None
    # the factor 1 + k is scaled: (1 + 0.2) · 1.1 − 1 = 0.32, (1 + 0.05) · 1.1 − 1 = 0.155
    assert s.p_busy_stretch == pytest.approx(0.32)
    assert [r[1] for r in s.interference] == pytest.approx([0.32, 0.155])
    assert s.terms(2.0)[0] == pytest.approx(0.32 + (0.155 - 0.32) / 3)
    # and nothing else: with the stretch terms put back, it is the same profile
    back = replace(s, p_busy_stretch=SPLIT.p_busy_stretch,
                   interference=tuple((r[0], o[1], *r[2:])
                                      for r, o in zip(s.interference, SPLIT.interference,
                                                      strict=True)))
    assert back == SPLIT and replace(got, split=SPLIT) == prof
    # a factor that falls below 1 means no stretch, never a negative one
    low = scaled(prof, 1.0, 1.0, 0.9).split
    assert low is not None and low.p_busy_stretch == pytest.approx(0.08)
    assert [r[1] for r in low.interference] == pytest.approx([0.08, 0.0])
    # with the other ratios: each on its own terms
    both = scaled(prof, 1.5, 2.0, 1.1).split
    assert both is not None and both.p_busy_stretch == pytest.approx(0.32)
    assert both.decode.a == pytest.approx(0.016)
    with pytest.raises(ValueError):
        scaled(prof, 1.0, 1.0, 0.0)


def test_a_scaled_stretch_simulates_as_the_stretch_it_stands_for() -> None:
    """A profile with stretch 0.2 scaled by a factor ratio 1.25 steps D exactly as one
    calibrated with stretch 0.5 (1.2 · 1.25 = 1.5) while P prefills."""
    from splitserve.sim.records import token_times
    from splitserve.sim.run import simulate

    base = SplitCost(0.0, 1.0, 0.05, 0.0, DecodeCost(0.008, 1e-6, 5e-4))
    wl = SimWorkload.of([0.0, 0.5, 1.2], [200, 1500, 900], [300, 5, 5])
    cfg = SimConfig("disagg", overlap=False)
    got = simulate(scaled(replace(make_profile(), split=replace(base, p_busy_stretch=0.2)),
                          1.0, 1.0, 1.25), cfg, wl)
    want = simulate(replace(make_profile(), split=replace(base, p_busy_stretch=0.5)), cfg, wl)
    plain = simulate(replace(make_profile(), split=replace(base, p_busy_stretch=0.2)), cfg, wl)
    assert token_times(got)[0] == pytest.approx(token_times(want)[0], rel=1e-12)
    assert token_times(got)[0][-1] > token_times(plain)[0][-1]


def test_the_modelled_canary_is_the_profiles_lone_request() -> None:
    """The speed canary simulated on a plain profile: TTFT the prompt's prefill, the gap the
    decode step at batch 1 and the canary's median context."""
    from splitserve.sim.calibration.drift import CanaryPlan, modelled_reference

    prof, plan = make_profile(), CanaryPlan(prompt=320, tokens=24, requests=3)
    ref = modelled_reference(prof, SimConfig("chunked", n_workers=1), Canary(speed=plan))
    assert ref.ttft_s == pytest.approx(prof.prefill.whole(320))
    # gaps from t2 on: the steps at contexts 320 + 2 .. 320 + 23; their median at 320 + 12.5
    assert ref.gap_s == pytest.approx(prof.decode.time(1, 320 + 12.5))
    assert ref.stretch is None
    jittered = replace(prof, gap_jitter_s=((-0.001, 500), (0.003, 500)))
    got = modelled_reference(jittered, SimConfig("chunked", n_workers=1), Canary(speed=plan))
    assert got.gap_s == pytest.approx(ref.gap_s + 0.001)  # the median of the spread gaps


def test_drift_against_the_modelled_canary_recovers_a_scaled_machine() -> None:
    """A machine that runs the profile 1.3x slow at prefill, 1.2x at decode and with a P-busy
    factor 1.1x as high reads, against the profile's own canary, those ratios (without the
    term that would mix them into TTFT: the router's time per request is decode-side)."""
    from splitserve.sim.calibration.drift import StretchPlan, modelled_reference

    prof = replace(make_profile(), split=replace(SPLIT, router_request_s=0.0))
    canary = Canary(stretch=StretchPlan(), decode=SPLIT.decode)
    cfg = SimConfig("disagg")
    ref = modelled_reference(prof, cfg, canary)
    assert ref.stretch == pytest.approx(1.2, abs=0.02)  # the first row's stretch, 0.2
    drift = modelled_reference(scaled(prof, 1.3, 1.2, 1.1), cfg, canary).drift(ref)
    assert drift.prefill == pytest.approx(1.3, rel=1e-6)
    assert drift.decode == pytest.approx(1.2, rel=1e-6)
    assert drift.stretch == pytest.approx(1.1, abs=0.02)
