"""The disaggregated deployment's measured extra costs (`SplitCost`): closed forms, the profile
schema, and the calibration fits on synthetic measurements."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.sim.calibration.calibrate import (
    SplitPlan,
    base_prefill,
    fit_loaded,
    fit_lone,
    load_stream,
)
from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile, load_profile, save_profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

L, N = 400, 30
SPLIT = SplitCost(router_request_s=0.003, prefill_factor=1.2, handover_a_s=0.05,
                  handover_b_s=2e-5, decode=DecodeCost(0.009, 3e-6, 2e-3))


def _split_profile(split: SplitCost = SPLIT) -> Profile:
    return replace(make_profile(), split=split)


def _lone(profile: Profile, cfg: SimConfig, prompt: int = L, out: int = N):
    return simulate(profile, cfg, SimWorkload.of([1.0], [prompt], [out]))


def test_lone_request_disagg_ttft_and_handover_terms() -> None:
    """TTFT = factor·prefill + router; t2 − t1 = handover(l) + D's first step (measured
    cost)."""
    prof = _split_profile()
    o = _lone(prof, SimConfig("disagg", overlap=False))
    ttft = SPLIT.prefill_factor * prof.prefill.whole(L) + SPLIT.router_request_s
    assert o.first_token[0] - 1.0 == pytest.approx(ttft)
    xfer = 2 * 8 * 2 * 64 * 4 * L / 1e8 + 0.002
    handover = SPLIT.handover_a_s + SPLIT.handover_b_s * L
    assert handover > xfer  # so the handover, not the KV link, sets the join
    assert o.second_token[0] - o.first_token[0] == pytest.approx(
        handover + SPLIT.decode.time(1, L + 1))
    steps = sum(SPLIT.decode.time(1, L + 1 + j) for j in range(N - 1))
    assert o.finish[0] - o.first_token[0] == pytest.approx(handover + steps)


def test_slow_link_still_bounds_the_join() -> None:
    prof = replace(_split_profile(), transfer={"tcp": replace(make_profile().link("tcp"),
                                                              bandwidth_Bps=1e6)})
    o = _lone(prof, SimConfig("disagg", overlap=False))
    xfer = 2 * 8 * 2 * 64 * 4 * L / 1e6 + 0.002
    assert o.second_token[0] - o.first_token[0] == pytest.approx(
        xfer - SPLIT.router_request_s + SPLIT.decode.time(1, L + 1))


def test_split_costs_can_be_turned_off_and_leave_colocated_alone() -> None:
    plain, split = make_profile(), _split_profile()
    for cfg in (SimConfig("disagg", split_costs=False), SimConfig("chunked", n_workers=1),
                SimConfig("colocated", n_workers=1)):
        a, b = _lone(plain, cfg), _lone(split, cfg)
        assert a.first_token == pytest.approx(b.first_token)
        assert a.finish == pytest.approx(b.finish)


def test_profile_schema_2_round_trips_and_schema_1_still_loads(tmp_path: Path) -> None:
    prof = _split_profile(replace(SPLIT, t1_relay_s=0.1, fit={"lone_points": [[64, 0.1, 0.02]]}))
    save_profile(prof, tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["schema"] == "splitserve.profile/2" and d["split"]["decode"]["a"] == 0.009
    assert load_profile(tmp_path / "p.json") == prof
    old = make_profile().to_dict() | {"schema": "splitserve.profile/1"}
    old.pop("split")
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "old.json").split is None
    with pytest.raises(ValueError, match="schema"):
        Profile.from_dict(old | {"schema": "splitserve.profile/9"})
    with pytest.raises(ValueError):
        replace(SPLIT, prefill_factor=0.0)


def test_fit_lone_recovers_router_factor_and_handover() -> None:
    base = make_profile()
    dec = SPLIT.decode
    pts = [(n, 0.004 + 1.3 * base_prefill(base, n), 0.015 + 3e-5 * n + dec.time(1, n + 1))
           for n in (64, 256, 512, 1024) for _ in range(2)]
    r0, factor, ha, hb, quality = fit_lone(base, pts, dec)
    assert (r0, factor, ha, hb) == pytest.approx((0.004, 1.3, 0.015, 3e-5), rel=1e-6)
    assert quality["median_abs_rel_error"] < 1e-9


def test_fit_loaded_recovers_the_relay_wait_that_produced_the_median_ttft() -> None:
    """Simulate the loaded calibration stream with a known relay wait; the fit finds it
    again."""
    value = 0.012
    truth = replace(SPLIT, t1_relay_s=value)
    reqs = load_stream(SplitPlan(load_requests=20, load_output=200))  # each t1 meets a busy D
    wl = SimWorkload.of([r.arrival_s for r in reqs], [r.input_len for r in reqs],
                        [r.output_len for r in reqs])
    cfg = SimConfig("disagg")
    res = summarize(simulate(_split_profile(truth), cfg, wl))
    got = fit_loaded(_split_profile(), cfg, wl, res["median_ttft_ms"] / 1e3)
    assert got == pytest.approx(value, rel=0.02)
    # a stream whose requests end before the next one's t1 cannot show a relay wait
    short = SimWorkload.of([0.0, 2.0, 4.0], [100] * 3, [5] * 3)
    assert fit_loaded(_split_profile(), cfg, short, 10.0) == 0.0


def test_t1_waits_for_the_relay_only_while_its_d_runs_streams() -> None:
    """A lone request's TTFT is P's prefill and the router's time; one that finishes its
    prefill while its D decodes another stream gets `t1_relay_s` on top, and so does its
    handover's start (the leg joins after t1)."""
    split = replace(SPLIT, t1_relay_s=0.01)
    wl = SimWorkload.of([0.0, 0.3], [200, 200], [100, 10])
    cfg = SimConfig("disagg", overlap=False)
    with_relay = simulate(_split_profile(split), cfg, wl)
    without = simulate(_split_profile(SPLIT), cfg, wl)
    assert with_relay.first_token[0] == pytest.approx(without.first_token[0])  # D idle
    assert with_relay.first_token[1] == pytest.approx(without.first_token[1] + 0.01)


def test_gap_jitter_adds_seconds_to_step_gaps_whatever_their_length() -> None:
    """Additive jitter (`gap_jitter_s`): every step gap g becomes g + s in s's share; a long
    gap spreads no wider than a short one."""
    from splitserve.sim.results import itl_samples

    wl = SimWorkload.of([0.0, 0.5, 1.0], [L, L, L], [20, 20, 20])
    flat = simulate(_split_profile(), SimConfig("disagg"), wl)
    bins = ((-0.002, 500), (0.004, 500))
    prof = _split_profile(replace(SPLIT, gap_jitter_s=bins))
    noisy = simulate(prof, SimConfig("disagg"), wl)
    v0, w0 = itl_samples(flat)
    v1, w1 = itl_samples(noisy)
    hand = int((wl.output_lens > 1).sum())
    steps0 = v0[:-hand]
    assert v1[:-hand] == pytest.approx((steps0[:, None] + [-0.002, 0.004]).ravel())
    assert w1[:-hand].tolist() == (w0[:-hand][:, None] * [500, 500]).ravel().tolist()
    assert v1[-hand:] == pytest.approx(v0[-hand:])  # handovers carry no jitter


def test_window_jitter_is_each_gap_less_its_streams_local_pace() -> None:
    from splitserve.bench.client import RequestRecord
    from splitserve.sim.calibration.jitter import window_jitter

    def rec(gaps: list[float]) -> RequestRecord:
        times = [0.0, 0.1]  # TTFT, then t2 at 0.1: the window starts at the last t2
        for g in gaps:
            times.append(times[-1] + g)
        return RequestRecord(0, "normal", 10, len(times), 0.0, chunk_times=times)

    # each stream's first gap in the window (0.020, 0.030) carries the last joiner's t2 relay
    drifting = rec([0.020, 0.011, 0.012, 0.013, 0.014, 0.015])  # the context grows: no jitter
    spiky = rec([0.030, 0.010, 0.010, 0.020, 0.010, 0.010, 0.020])  # ends last
    got = window_jitter([drifting, spiky])
    # the window ends at the drifting stream's end (0.185): its 5 gaps after the first, and the
    # spiky one's 4 (0.01/0.01/0.02/0.01), whose line runs 0.011 + 0.001·i
    assert got[:5] == pytest.approx([0.0] * 5, abs=1e-12)
    assert got[5:] == pytest.approx([-0.001, -0.002, 0.007, -0.004])
