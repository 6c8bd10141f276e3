"""The simulator against results that can be written down."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.sim.costmodel import PrefillCost, TransferLink, transfer_arrival
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

L, N = 400, 30


def _lone(profile: Profile, cfg: SimConfig, prompt: int = L, out: int = N):
    return simulate(profile, cfg, SimWorkload.of([1.0], [prompt], [out]))


def _decode_sum(profile: Profile, prompt: int, steps: int) -> float:
    d = profile.decode
    return sum(d.time(1, prompt + 1 + j) for j in range(steps))


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_md1_mean_wait(mode: str) -> None:
    """One worker, Poisson arrivals, a fixed prompt served one per step: M/D/1, whose mean
    wait is ρ·D / (2(1 − ρ))."""
    prof = make_profile(budget=L)
    service = prof.prefill.whole(L)
    rho, n = 0.6, 200_000
    rng = np.random.default_rng(7)
    arrivals = np.cumsum(rng.exponential(service / rho, size=n))
    wl = SimWorkload(arrivals, np.full(n, L), np.ones(n, dtype=np.int64))
    cfg = SimConfig(mode, n_prefill=1, n_decode=1, n_workers=1)
    o = simulate(prof, cfg, wl)
    wait = o.first_token - o.arrivals - service
    expected = rho * service / (2 * (1 - rho))
    assert wait.min() >= -1e-9
    assert wait.mean() == pytest.approx(expected, rel=0.03)


def test_lone_request_colocated_matches_cost_model(profile: Profile) -> None:
    o = _lone(profile, SimConfig("colocated", n_workers=1))
    assert o.first_token[0] - 1.0 == pytest.approx(profile.prefill.whole(L))
    tpot = (o.finish[0] - o.first_token[0]) / (N - 1)
    assert tpot == pytest.approx(_decode_sum(profile, L, N - 1) / (N - 1))
    assert o.second_token[0] - o.first_token[0] == pytest.approx(profile.decode.time(1, L + 1))


def test_lone_request_disagg_ttft_tpot_and_transfer(profile: Profile) -> None:
    o = _lone(profile, SimConfig("disagg", overlap=False))
    prefill = profile.prefill.whole(L)
    xfer = 2 * 8 * 2 * 64 * 4 * L / 1e8 + 0.002  # bytes / bandwidth + latency
    assert o.first_token[0] - 1.0 == pytest.approx(prefill)
    assert o.kv_transfer_s[0] == o.kv_tail_s[0] == pytest.approx(xfer)  # all after P
    assert o.second_token[0] - o.first_token[0] == pytest.approx(
        xfer + profile.decode.time(1, L + 1))
    tpot = (o.finish[0] - o.first_token[0]) / (N - 1)
    assert tpot == pytest.approx((xfer + _decode_sum(profile, L, N - 1)) / (N - 1))


def test_overlapped_transfer_hides_behind_prefill() -> None:
    fast = TransferLink(1e8, 0.002)
    nbytes, layers = 4e6, 8  # 40 ms on the link; the prefill takes 400 ms
    plain, _ = transfer_arrival(fast, nbytes, layers, 0.0, 0.4, overlap=False)
    lapped, _ = transfer_arrival(fast, nbytes, layers, 0.0, 0.4, overlap=True)
    assert plain == pytest.approx(0.4 + 0.04 + 0.002)
    assert lapped == pytest.approx(0.4 + 0.04 / layers + 0.002)  # only the last layer is exposed
    slow = TransferLink(1e7, 0.0)  # 400 ms on the link: the link is the bottleneck
    lapped, _ = transfer_arrival(slow, nbytes, layers, 0.0, 0.4, overlap=True)
    assert lapped == pytest.approx(0.4 / layers + 0.4)


def test_overlap_in_simulation_shortens_handover(profile: Profile) -> None:
    plain = _lone(profile, SimConfig("disagg", overlap=False))
    lapped = _lone(profile, SimConfig("disagg", overlap=True))
    send = 2 * 8 * 2 * 64 * 4 * L / 1e8
    gap = (plain.second_token - lapped.second_token)[0]
    assert gap == pytest.approx(send - send / 8)


def test_shared_link_serialises_transfers() -> None:
    prof = make_profile(link=TransferLink(1e7, 0.0))
    wl = SimWorkload.of([0.0, 0.0], [L, L], [5, 5])
    send = 2 * 8 * 2 * 64 * 4 * L / 1e7
    own = simulate(prof, SimConfig("disagg", n_prefill=2, n_decode=2, overlap=False), wl)
    shared = simulate(prof, SimConfig("disagg", n_prefill=2, n_decode=2, overlap=False,
                                      shared_link=True), wl)
    assert own.kv_tail_s == pytest.approx([send, send])
    assert sorted(shared.kv_tail_s) == pytest.approx([send, 2 * send])
    # each transfer, once on the link, moves for `send`: the wait for the link is tail only
    assert own.kv_transfer_s == pytest.approx([send, send])
    assert shared.kv_transfer_s == pytest.approx([send, send])


def test_join_cuts_a_decode_segment_at_the_next_step() -> None:
    """A request arriving mid-decode joins at the next step boundary; checked against a
    step-by-step loop."""
    prof = make_profile(prefill=PrefillCost(0.0, 0.0, 0.0))
    wl = SimWorkload.of([0.0, 0.0123], [100, 50], [40, 10])
    o = simulate(prof, SimConfig("colocated", n_workers=1), wl)
    d = prof.decode
    # reference: the first prefill is free; the second arrives mid-step, its (free) prefill
    # rides in the next step beside the running decode, and it decodes from the step after.
    t, ctx, left, finish, pending = 0.0, {0: 101}, {0: 39}, {}, True
    while left:
        joining = pending and t >= 0.0123
        dt = d.time(len(left), sum(ctx.values()))
        t += dt
        for r in list(left):
            ctx[r] += 1
            left[r] -= 1
            if left[r] == 0:
                finish[r] = t
                del left[r], ctx[r]
        if joining:
            pending = False
            ctx[1], left[1] = 51, 9
            assert o.first_token[1] == pytest.approx(t)
    assert o.finish[0] == pytest.approx(finish[0])
    assert o.finish[1] == pytest.approx(finish[1])


def test_chunked_prefill_keeps_the_quadratic_cost() -> None:
    prof = make_profile(budget=128)
    o = simulate(prof, SimConfig("chunked", n_workers=1), SimWorkload.of([0.0], [500], [1]))
    chunks = 4  # 128 + 128 + 128 + 116
    pf = prof.prefill
    assert o.first_token[0] == pytest.approx(chunks * pf.a + pf.b * 500 + pf.c * 500 ** 2)


def test_kv_capacity_holds_requests_back() -> None:
    prof = make_profile(capacity=600)
    wl = SimWorkload.of([0.0, 0.0, 0.0], [300, 300, 800], [100, 100, 10])
    o = simulate(prof, SimConfig("colocated", n_workers=1), wl)
    assert list(o.failed) == [False, False, True]  # 800 tokens can never fit
    assert o.first_token[1] >= o.finish[0]  # the second waits for the first's KV


def test_overlapped_push_spans_the_prefill_and_exposes_its_tail(profile: Profile) -> None:
    """A layer-wise push's transfer (the benchmark's BEGIN → END) starts once P's first layer
    is computed, so it spans most of the prefill; its exposed tail starts at P's prefill end.
    Both reach the result under the benchmark's keys."""
    o = _lone(profile, SimConfig("disagg", overlap=True))
    prefill, layers = profile.prefill.whole(L), 8
    send, latency = 2 * 8 * 2 * 64 * 4 * L / 1e8, 0.002
    assert send < prefill  # the link keeps up: only the last layer's share is exposed
    tail = send / layers + latency
    span = prefill - prefill / layers + tail
    assert o.kv_tail_s[0] == pytest.approx(tail)
    assert o.kv_transfer_s[0] == pytest.approx(span)
    res = summarize(o)
    for stat in ("mean", "median", "p99"):
        assert res[f"{stat}_kv_tail_ms"] == pytest.approx(1000 * tail)
        assert res[f"{stat}_kv_transfer_ms"] == pytest.approx(1000 * span)
    colocated = summarize(_lone(profile, SimConfig("colocated", n_workers=1)))
    assert not any(k.endswith(("_kv_tail_ms", "_kv_transfer_ms")) for k in colocated)


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_router_hop_delays_a_colocated_request_by_one_hop(profile: Profile, mode: str) -> None:
    """Every request goes through the router: a colocated worker's request reaches it one hop
    later, so all its tokens (TTFT and the end) come one hop later and its gaps are the same."""
    hop = 0.1
    base = _lone(profile, SimConfig(mode, n_workers=1))  # type: ignore[arg-type]
    hopped = _lone(profile, SimConfig(mode, n_workers=1, router_hop_s=hop))  # type: ignore[arg-type]
    assert hopped.first_token[0] == pytest.approx(base.first_token[0] + hop)
    assert hopped.second_token[0] == pytest.approx(base.second_token[0] + hop)
    assert hopped.finish[0] == pytest.approx(base.finish[0] + hop)


def test_router_hop_delays_a_request_prefilled_on_d_as_one_split_on_p() -> None:
    """A request prefilled on its D pays the router hop on its first token, as one prefilled on
    P does: the hop adds one hop to both TTFTs."""
    blocks = ((1, 2, 3, 4), (1, 2, 3, 4, 5))  # the second: all but its last 16 tokens on D
    wl = SimWorkload(np.array([0.0, 5.0]), np.array([64, 80]), np.array([4, 4]), blocks, 16)
    prof = make_profile()
    ttft = {}
    for hop in (0.0, 0.1):
        cfg = SimConfig("disagg", p_policy="cache", d_policy="cache", router_hop_s=hop)
        o = simulate(prof, cfg, wl)
        assert o.local is not None and o.local.tolist() == [False, True]
        ttft[hop] = o.first_token - o.arrivals
    assert ttft[0.1] == pytest.approx(ttft[0.0] + 0.1)
