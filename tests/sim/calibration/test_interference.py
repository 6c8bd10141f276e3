"""D's interference terms: the simulator's closed forms, and the probe's fit recovering the
terms from records that the simulator produced with them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace

import pytest

from splitserve.bench.client import RequestRecord
from splitserve.sim.calibration.calibrate import stream_medians
from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.calibration.interference import (
    InterferencePlan,
    fit_interference,
    gap_rows,
    interference_rows,
    probe_stream,
)
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.records import request_records, token_times
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

DEC = DecodeCost(0.008, 1e-6, 5e-4)
SPLIT = SplitCost(router_request_s=0.0, prefill_factor=1.0, handover_a_s=0.05,
                  handover_b_s=0.0, decode=DEC)
CFG = SimConfig("disagg", overlap=False)


def _prof(**terms: float) -> Profile:
    return replace(make_profile(), split=replace(SPLIT, **terms))


def _gaps(prof: Profile, wl: SimWorkload, r: int = 0) -> list[float]:
    t = token_times(simulate(prof, CFG, wl))[r]
    return [b - a for a, b in zip(t[1:], t[2:], strict=False)]


def test_lone_request_pays_the_join_once_and_nothing_else() -> None:
    prof = _prof(p_busy_stretch=0.5, arrive_s=0.003, t1_s=0.004, join_s=0.002, finish_s=0.001)
    o = simulate(prof, CFG, SimWorkload.of([1.0], [300], [10]))
    assert o.second_token[0] - o.first_token[0] == pytest.approx(0.05 + DEC.time(1, 301) + 0.002)
    g = _gaps(prof, SimWorkload.of([1.0], [300], [10]))
    assert g == pytest.approx([DEC.time(1, 302 + j) for j in range(8)])


def test_d_steps_stretch_while_p_prefills_and_events_land_on_their_steps() -> None:
    """One stream decodes alone; a second request arrives, P prefills it: every D step that
    starts while P prefills takes 1.5× the calibrated step; the arrival adds its seconds to
    D's next step, t1 to the step in progress at t1, the join to the joiner's first step, the
    end to the step after."""
    terms = dict(p_busy_stretch=0.5, arrive_s=0.003, t1_s=0.004, join_s=0.002, finish_s=0.001)
    wl = SimWorkload.of([0.0, 0.5], [200, 1500], [400, 5])
    o = simulate(_prof(**terms), CFG, wl)
    recs = request_records(o)
    rows = gap_rows(recs, 1, DEC)
    t1 = o.first_token[1]
    stretched = [(g, p) for _, g, p, _, _ in rows if g / p == pytest.approx(1.5, rel=1e-9)]
    assert len(stretched) == pytest.approx((t1 - 0.5) / (1.5 * DEC.time(1, 500)), abs=2)
    excess = {round(g - p * (1.5 if g / p > 1.5 else 1.0), 9) for _, g, p, _, _ in rows}
    assert {0.003, 0.004, 0.002, 0.001} <= excess  # each event's seconds on one step
    # t1's on the gap that holds it, the join's on the join step (its end nearest t2)
    by_event = {ev: round(g - p * (1.5 if g / p > 1.5 else 1.0), 9) for _, g, p, _, ev in rows
                if ev}
    assert by_event[("t1",)] == 0.004 and by_event[("join",)] == 0.002


def test_fit_interference_recovers_the_terms_from_simulated_probe_records() -> None:
    ip = InterferencePlan(injections=12)
    reqs = probe_stream(ip, 2, 700, lambda n: (1,) * n)
    wl = SimWorkload.of([r.arrival_s for r in reqs], [r.input_len for r in reqs],
                        [r.output_len for r in reqs])
    truth = dict(p_busy_stretch=0.2, arrive_s=0.004, t1_s=0.005, join_s=0.003, finish_s=0.002)
    recs = request_records(simulate(_prof(**truth), SimConfig("disagg"), wl))
    kappa, cost, q = fit_interference(gap_rows(recs, 2, DEC))
    assert q["idle_pace"] == pytest.approx(1.0, abs=1e-6)
    assert kappa == pytest.approx(0.2, abs=0.01)
    # the fit reads each event where the simulator puts it (arrival: the step after it, the
    # one P's prefill starts in, so stretched too)
    # t1 and the arrival fall in gaps partly inside P's prefill, which the simulator stretches
    # by P's state at the step's start and the fit by the busy fraction: a share of a step's
    # stretch (<= 0.2 × 8 ms) may move into or out of them
    for name, want, tol in (("arrive", 0.004, 2e-3), ("t1", 0.005, 2e-3), ("join", 0.003, 5e-4),
                            ("finish", 0.002, 5e-4)):
        assert cost[name] == pytest.approx(want, abs=tol), name


# (others, stretch, arrive, t1, join, finish, t2)
ROWS = ((1.0, 0.4, 0.003, 0.004, 0.002, 0.001, 0.0025), (3.0, 0.1, 0.001, 0.002, 0.001, 0.0, 0.001))


def test_terms_interpolate_between_rows_and_hold_beyond_them() -> None:
    s = replace(SPLIT, p_busy_stretch=9.0, interference=ROWS)  # rows replace the scalars
    assert s.terms(0) == pytest.approx(ROWS[0][1:])
    assert s.terms(1) == pytest.approx(ROWS[0][1:])
    assert s.terms(2) == pytest.approx((0.25, 0.002, 0.003, 0.0015, 0.0005, 0.00175))
    assert s.terms(3) == pytest.approx(ROWS[1][1:]) and s.terms(50) == pytest.approx(ROWS[1][1:])
    assert replace(SPLIT, p_busy_stretch=0.3, t1_s=0.01).terms(7) == (0.3, 0.0, 0.01, 0.0, 0.0,
                                                                      0.0)
    back = SplitCost.from_dict(json.loads(json.dumps(asdict(replace(SPLIT, interference=ROWS)))))
    assert back.interference == ROWS
    with pytest.raises(ValueError):
        replace(SPLIT, interference=(ROWS[1], ROWS[0]))
    with pytest.raises(ValueError, match="7 numbers"):
        replace(SPLIT, interference=tuple(r[:6] for r in ROWS))


@pytest.mark.parametrize("bg", [1, 2, 3])
def test_d_stretch_while_p_prefills_follows_ds_batch(bg: int) -> None:
    """`bg` streams decode; a request arrives and P prefills it: D's steps that start meanwhile
    take 1 + terms(bg)[0] times the calibrated step (0.4 at 1 stream, 0.25 at 2, 0.1 at 3)."""
    prof = _prof(interference=ROWS)
    wl = SimWorkload.of([0.0] * bg + [0.8], [200] * bg + [1500], [400] * bg + [5])
    recs = request_records(simulate(prof, CFG, wl))
    kappa = prof.split.terms(bg)[0]
    rows = gap_rows(recs, bg, DEC)
    # inside P's prefill, past the step that carries the arrival's seconds
    busy = [g / p for prev, (_, g, p, pb, ev) in zip(rows, rows[1:], strict=False)
            if pb >= 1.0 and not ev and not prev[4] and prev[3] >= 1.0]
    assert len(busy) >= 3 * bg and busy == pytest.approx([1.0 + kappa] * len(busy))


def test_probe_fit_per_background_batch_recovers_the_rows() -> None:
    """The probe at 1 and 3 background streams, simulated with ROWS, gives ROWS back (the
    events that fall partly inside P's prefill within a share of a step's stretch)."""
    ip = InterferencePlan(bg_batches=(1, 3), injections=12)
    prof = _prof(interference=ROWS)
    fits = []
    for bg in ip.bg_batches:
        reqs = probe_stream(ip, bg, 900, lambda n: (1,) * n)
        wl = SimWorkload.of([r.arrival_s for r in reqs], [r.input_len for r in reqs],
                            [r.output_len for r in reqs])
        recs = request_records(simulate(prof, SimConfig("disagg"), wl))
        kappa, cost, _ = fit_interference(gap_rows(recs, bg, DEC))
        fits.append((bg, kappa, cost))
    rows = interference_rows(fits)
    assert [r[0] for r in rows] == [1.0, 3.0]
    for got, want in zip(rows, ROWS, strict=True):
        assert got[1] == pytest.approx(want[1], abs=0.01)
        assert got[4:] == pytest.approx(want[4:], abs=5e-4)  # join, finish, t2
        assert got[2:4] == pytest.approx(want[2:4], abs=3e-3)  # arrive, t1


def _answered_by(truth: Profile) -> Callable[[str, list, int | None], list]:
    """A stand-in for `profile._run` whose requests the simulator answers on `truth` (one at
    a time: each alone)."""
    def run(url: str, reqs: list, concurrency: int | None) -> list:
        def sim(rs: list) -> list:
            wl = SimWorkload.of([r.arrival_s for r in rs], [r.input_len for r in rs],
                                [r.output_len for r in rs])
            return request_records(simulate(truth, SimConfig("disagg"), wl))
        if concurrency == 1:
            return [sim([r])[0] for r in reqs]
        return sim(reqs)
    return run


def test_calibrate_split_against_a_simulated_deployment_recovers_the_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`calibrate_split` end to end, its requests answered by the simulator running a known
    split profile: the interference rows (one per background batch), the first row in the
    scalars, and additive jitter bins (none here: the simulated gaps do not jitter)."""
    from splitserve.sim.calibration import calibrate

    truth = _prof(interference=ROWS, p_busy_stretch=ROWS[0][1])
    monkeypatch.setattr(calibrate, "_run", _answered_by(truth))
    plan = calibrate.SplitPlan(interference=InterferencePlan(bg_batches=(1, 3), injections=12))
    calibrated = calibrate.calibrate_split("sim://", make_profile(), plan, say=lambda _: None)
    got = calibrated.split
    assert got is not None and [r[0] for r in got.interference] == [1.0, 3.0]
    # the terms are read against the decode fitted through this deployment: within 0.03
    # stretch and 0.5 ms per event
    for row, want in zip(got.interference, ROWS, strict=True):
        assert row[1] == pytest.approx(want[1], abs=0.03)
        assert row[4:] == pytest.approx(want[4:], abs=5e-4)
    assert (got.p_busy_stretch, got.join_s) == (got.interference[0][1], got.interference[0][4])
    # its windows begin past the handovers' steps (`after_handovers`), so it is DEC itself
    assert (got.decode.a, got.decode.c) == pytest.approx((DEC.a, DEC.c), rel=0.03)
    assert all(abs(s) < 5e-4 for s, _ in got.gap_jitter_s)  # steps grow with context
    # the profile keeps the probes' records: read back, they give the same rows and medians
    assert got.fit is not None
    for bg, row in zip(("1", "3"), got.interference, strict=True):
        recs = [RequestRecord.from_dict(d) for d in got.fit["interference"][bg]["records"]]
        kappa, cost, _ = fit_interference(gap_rows(recs, int(bg), got.decode))
        assert (kappa, *cost.values()) == pytest.approx(row[1:], rel=1e-3, abs=1e-5)  # 1 µs
    load = [RequestRecord.from_dict(d) for d in got.fit["load"]["records"]]
    assert stream_medians(load) == pytest.approx(
        (got.fit["load"]["median_ttft_s"], got.fit["load"]["median_itl_s"]), abs=2e-6)
    # fitted again from what the profile keeps (`splitserve profile --refit`): the same costs
    again = calibrate.refit_split(calibrated).split
    assert again is not None and again.decode == got.decode
    for a, b in zip(again.interference, got.interference, strict=True):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-5)
    assert again.t1_relay_s == pytest.approx(got.t1_relay_s, rel=1e-3, abs=1e-6)
    assert (again.handover_a_s, again.prefill_factor) == pytest.approx(
        (got.handover_a_s, got.prefill_factor), rel=1e-3, abs=1e-6)
    assert "refitted" in again.fit and again.fit["measured"] == got.fit["measured"]
    old = replace(calibrated, split=replace(got, fit={k: v for k, v in got.fit.items()
                                                      if k != "load"}))
    with pytest.raises(ValueError, match="no probe records"):
        calibrate.refit_split(old)


def test_the_loaded_term_is_fitted_net_of_the_loaded_streams_minute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded stream (and the canaries just before and after it) ran on a machine 15 %
    slower at prefill and 10 % at decode than the probes before it: against the canaries, the
    fit finds the relay wait the probes' machine has; without them, it absorbs the minute."""
    from splitserve.bench.workload import Request
    from splitserve.sim.calibration import calibrate
    from splitserve.sim.calibration.drift import scaled

    truth = _prof(interference=ROWS, p_busy_stretch=ROWS[0][1], t1_relay_s=0.01)
    monkeypatch.setattr(calibrate, "_run", _answered_by(truth))
    plan = calibrate.SplitPlan(interference=InterferencePlan(bg_batches=(1, 3), injections=12))
    base = make_profile()
    got = calibrate.calibrate_split("sim://", base, plan, say=lambda _: None).split
    assert got is not None and got.fit is not None
    assert got.fit["load"]["drift"] == pytest.approx({"prefill": 1.0, "decode": 1.0}, abs=0.01)
    assert got.t1_relay_s == pytest.approx(0.01, rel=0.05)
    m = calibrate.SplitMeasurements.from_fit(got.fit)
    assert len(m.load_canaries) == 2
    slow = _answered_by(scaled(truth, 1.15, 1.10))
    stream = [Request(r.index, r.scheduled_s, (1,) * r.input_len, r.requested_output_len)
              for r in m.load]
    canary = calibrate.canary_requests(calibrate.CanaryPlan())
    minute = replace(m, load=slow("sim://", stream, None),
                     load_canaries=(calibrate.Speed.of(slow("sim://", canary, 1)),) * 2)
    again = calibrate.split_costs(base, minute, SimConfig("disagg"), "test").split
    assert again is not None
    assert again.fit["load"]["drift"]["prefill"] == pytest.approx(1.15, rel=0.02)
    assert again.t1_relay_s == pytest.approx(got.t1_relay_s, rel=0.1)
    blind = calibrate.split_costs(base, replace(minute, load_canaries=()), SimConfig("disagg"),
                                  "test").split
    assert blind is not None and blind.t1_relay_s > 2 * got.t1_relay_s


@pytest.mark.parametrize("router_s", [0.0, 0.008, 0.016])
def test_t1_lands_where_the_client_sees_it_whatever_the_routers_time(router_s: float) -> None:
    """t1's seconds extend D's step in progress when the client gets t1 (P's step end plus the
    router's time per request), which is the gap the probe's fit reads them from."""
    ip = InterferencePlan(injections=12)
    reqs = probe_stream(ip, 1, 700, lambda n: (1,) * n)
    wl = SimWorkload.of([r.arrival_s for r in reqs], [r.input_len for r in reqs],
                        [r.output_len for r in reqs])
    prof = replace(_prof(t1_s=0.005, join_s=0.002, t2_s=0.003),
                   split=replace(_prof().split, t1_s=0.005, join_s=0.002, t2_s=0.003,
                                 router_request_s=router_s))
    _, cost, _ = fit_interference(gap_rows(request_records(simulate(prof, CFG, wl)), 1, DEC))
    assert (cost["t1"], cost["join"], cost["t2"]) == pytest.approx((0.005, 0.002, 0.003),
                                                                   abs=2e-4)


def test_work_charged_while_d_drains_does_not_reach_a_later_request() -> None:
    """A request's t2 relay (or an arrival) charged on the step that empties D is dropped with
    that step: the next request, seconds later, pays only its own handover."""
    wl = SimWorkload.of([0.0, 10.0], [300, 300], [2, 10])
    lone = 0.05 + DEC.time(1, 301) + 0.002  # handover_a + D's first step + its join
    for terms in ({"t2_s": 0.05}, {"arrive_s": 0.05}, {}):
        o = simulate(_prof(join_s=0.002, **terms), CFG, wl)
        assert o.second_token[1] - o.first_token[1] == pytest.approx(lone), terms


def test_a_join_belongs_to_the_gap_ending_nearest_it_else_to_the_one_holding_it() -> None:
    from splitserve.sim.calibration.interference import _join_gap

    t = [0.0, 0.1, 0.11, 0.17, 0.18]  # gaps (0.1, 0.11], (0.11, 0.17], (0.17, 0.18]
    assert _join_gap(t, 0.171) == 1  # just after the end of gap 1: its join step
    assert _join_gap(t, 0.109) == 0
    assert _join_gap(t, 0.125) == 1  # nearest end 0.11 is farther than half of gap 0: holder
    assert _join_gap(t, 0.5) is None and _join_gap(t, 0.05) is None and _join_gap([0.0], 1) is None
