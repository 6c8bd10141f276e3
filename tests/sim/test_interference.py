"""D's interference terms: the simulator's closed forms, and the probe's fit recovering the
terms from records that the simulator produced with them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.sim.deployment import SimConfig
from splitserve.sim.interference import InterferencePlan, fit_interference, gap_rows, probe_stream
from splitserve.sim.model import DecodeCost, Profile, SplitCost
from splitserve.sim.records import request_records, token_times
from splitserve.sim.simulator import simulate
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


def test_d_steps_stretch_while_p_prefills_and_events_land_on_the_next_step() -> None:
    """One stream decodes alone; a second request arrives, P prefills it: every D step that
    starts while P prefills takes 1.5× the calibrated step; the arrival and t1 add their
    seconds to D's next step, the join to the joiner's first step, the end to the step after."""
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


def test_fit_interference_recovers_the_terms_from_simulated_probe_records() -> None:
    ip = InterferencePlan()
    reqs = probe_stream(ip, 700, lambda n: (1,) * n)
    wl = SimWorkload.of([r.arrival_s for r in reqs], [r.input_len for r in reqs],
                        [r.output_len for r in reqs])
    truth = dict(p_busy_stretch=0.2, arrive_s=0.004, t1_s=0.005, join_s=0.003, finish_s=0.002)
    recs = request_records(simulate(_prof(**truth), SimConfig("disagg"), wl))
    kappa, cost, q = fit_interference(gap_rows(recs, ip.bg_batch, DEC))
    assert q["idle_pace"] == pytest.approx(1.0, abs=1e-6)
    assert kappa == pytest.approx(0.2, abs=0.01)
    # the simulator puts an event's seconds on the step after it: the gap holding it alone
    # is the one the fit reads (arrival: the step P's prefill starts in, so stretched too)
    # t1 and the arrival fall in gaps partly inside P's prefill, which the simulator stretches
    # by P's state at the step's start and the fit by the busy fraction: a share of a step's
    # stretch (<= 0.2 × 8 ms) may move into or out of them
    for name, want, tol in (("arrive", 0.004, 2e-3), ("t1", 0.005, 2e-3), ("join", 0.003, 5e-4),
                            ("finish", 0.002, 5e-4)):
        assert cost[name] == pytest.approx(want, abs=tol), name
