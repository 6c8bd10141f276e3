"""The simulator's prefix caches on streams small enough to check by hand: hits, pins, LRU
eviction order (tail first, as vLLM frees), the router's index, and what a run reports."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from splitserve.routing.prefix import prefill_on_d, reusable
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.prefixcache import PrefixCaches
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

B = 4  # tokens a block


def caches(blocks: list[tuple[int, ...]], lens: list[int], capacity_tokens: int = 1000,
           workers: int = 2) -> PrefixCaches:
    return PrefixCaches(blocks, B, lens, [capacity_tokens] * workers)


def test_reuse_is_whole_blocks_below_the_last_prompt_token() -> None:
    assert reusable(8, 9, B) == 8
    assert reusable(8, 8, B) == 4  # the engine computes the last token: one block less
    assert reusable(12, 10, B) == 8
    assert reusable(0, 10, B) == 0
    assert prefill_on_d(8, 10, 2) and not prefill_on_d(8, 11, 2)
    assert not prefill_on_d(0, 1, 128) and not prefill_on_d(8, 10, 0)


def test_a_stored_prompt_is_hit_by_its_full_blocks_only() -> None:
    c = caches([(1, 2, 3), (1, 2, 4)], [11, 12])
    assert c.hit(0, 1) == 0
    c.pin(0, 0, 0)
    c.store(0, 0)  # 11 tokens: blocks 1, 2 full; 3 partial (never stored)
    assert c.held_blocks(0, 1) == 2 and c.hit(0, 1) == 8 and c.hit(1, 1) == 0
    assert 3 not in c.workers[0]
    assert c.cached_on(1, 0, 2) == {"0": 8}
    assert c.cached_on(1, 1, 1) == {}


def test_pinned_blocks_survive_eviction_and_the_lru_goes_tail_first() -> None:
    # capacity 3 blocks; request 0 holds blocks 1,2,3 (12 tokens, 3 full blocks)
    c = caches([(1, 2, 3, 9), (7, 8, 9)], [13, 12], capacity_tokens=3 * B, workers=1)
    c.pin(0, 0, 0)
    c.store(0, 0)
    c.trim(0, used_tokens=3 * B)  # its KV fills the worker: nothing unpinned may stay
    assert all(k in c.workers[0] for k in (1, 2, 3))  # pinned: kept
    c.release(0, 0)
    assert list(c.workers[0].lru) == [3, 2, 1]  # freed tail first: the tail is evicted first
    c.trim(0, used_tokens=B)  # room for 2 unpinned blocks
    assert 3 not in c.workers[0] and 1 in c.workers[0] and 2 in c.workers[0]
    assert 3 not in c.holders and c.holders[1] == {0}


def test_a_hit_pins_its_blocks_and_touches_them() -> None:
    c = caches([(1, 2, 3), (1, 2, 5), (6, 7, 8)], [12, 12, 12], workers=1)
    for r in (0, 2):
        c.pin(0, r, 0)
        c.store(0, r)
        c.release(0, r)
    assert list(c.workers[0].lru) == [3, 2, 1, 8, 7, 6]
    c.pin(0, 1, c.hit(0, 1))  # reuses 8 tokens: blocks 1 and 2
    assert c.hits[1] == 8 and c.workers[0].pinned == {1: 1, 2: 1}
    c.trim(0, used_tokens=0)
    c.store(0, 1)
    c.release(0, 1)
    assert list(c.workers[0].lru) == [3, 8, 7, 6, 5, 2, 1]  # 1 and 2 are the most recent


def stream(turns: int, tail: int, gap_s: float = 2.0, prefixes: int = 3, block: int = 128
           ) -> SimWorkload:
    """`prefixes` prompts of two shared blocks, each asked `turns` times with a new tail."""
    arrivals, lens, blocks = [], [], []
    for turn in range(turns):
        for k in range(prefixes):
            arrivals.append(gap_s * len(arrivals))
            lens.append(2 * block + tail)
            own = 10_000 + 100 * turn + 10 * k
            blocks.append((1000 + k, 2000 + k) + tuple(own + j for j in range(-(-tail // block))))
    return SimWorkload(np.asarray(arrivals), np.asarray(lens), np.full(len(lens), 8),
                       tuple(blocks), block)


def run(profile: Profile, wl: SimWorkload, **kw: Any) -> dict[str, Any]:
    return summarize(simulate(profile, SimConfig(**kw), wl))


def test_cache_routing_finds_every_repeat_and_blind_routing_a_share(profile: Profile) -> None:
    wl = stream(turns=3, tail=150)
    # 9 prompts of 406 tokens; the 6 repeats reuse their 2 blocks: 6 * 256 / (9 * 406)
    best = 6 * 256 / (9 * 406)
    aware = run(profile, wl, n_prefill=2, n_decode=1, p_policy="cache", d_policy="cache")
    assert aware["prefix_hit_rate"] == pytest.approx(best)
    assert aware["computed_prompt_tokens"] == 9 * 406 - 6 * 256
    rr = run(profile, wl, n_prefill=2, n_decode=1, p_policy="round_robin",
             d_policy="cache", cache_aware=False)
    assert rr["prefix_hit_rate"] < best  # round robin over 2 P: a repeat lands away
    off = run(profile, wl, n_prefill=2, n_decode=1, p_policy="cache", prefix_caching=False)
    assert off["prefix_hit_rate"] is None and off["kv_bytes_moved"] is None


def test_d_gets_only_the_kv_it_lacks_and_runs_short_tails_itself(profile: Profile) -> None:
    kv = profile.model.kv_bytes_per_token
    wl = stream(turns=2, tail=150)
    aware = run(profile, wl, n_prefill=1, n_decode=1)
    blind = run(profile, wl, n_prefill=1, n_decode=1, cache_aware=False)
    assert blind["kv_bytes_moved"] == 6 * 406 * kv
    assert aware["kv_bytes_moved"] == (3 * 406 + 3 * (406 - 256)) * kv  # the repeats: deltas
    assert aware["local_prefills"] == blind["local_prefills"] == 0  # 150 new tokens > 128
    short = run(profile, stream(turns=2, tail=100), n_prefill=1, n_decode=1)
    assert short["local_prefills"] == 3 and short["prefix_hit_rate"] > 0
    assert short["kv_bytes_moved"] == 3 * 356 * kv  # the first turn's only
    never = run(profile, stream(turns=2, tail=100), n_prefill=1, n_decode=1,
                local_prefill_max_tokens=0)
    assert never["local_prefills"] == 0


def test_a_small_cache_evicts_and_hits_less(profile: Profile) -> None:
    wl = stream(turns=3, tail=150, prefixes=6)
    full = run(profile, wl, n_prefill=1, n_decode=1)
    small = run(make_profile(capacity=4 * 128 * 2), wl, n_prefill=1, n_decode=1)
    assert full["prefix_hit_rate"] > small["prefix_hit_rate"]


def test_a_lagging_index_sees_each_change_lag_s_after_it() -> None:
    """The router's index learns a block cached or evicted `lag_s` later (its event stream);
    the engine's own hit is immediate."""
    c = PrefixCaches([(1, 2, 3), (1, 2, 4)], B, [11, 12], [3 * B], lag_s=0.5)
    c.now = 1.0
    c.pin(0, 0, 0)
    c.store(0, 0)
    assert c.hit(0, 1) == 8  # the engine holds it now
    c.now = 1.4
    assert c.cached_on(1, 0, 1) == {}  # the index does not know yet
    c.now = 1.5
    assert c.cached_on(1, 0, 1) == {"0": 8}
    c.now = 2.0
    c.release(0, 0)
    c.trim(0, used_tokens=3 * B)  # the worker's KV is full: both blocks evicted at 2.0
    assert c.hit(0, 1) == 0
    c.now = 2.4
    assert c.cached_on(1, 0, 1) == {"0": 8}  # still believed cached
    c.now = 2.5
    assert c.cached_on(1, 0, 1) == {} and not c.holders
    with pytest.raises(ValueError, match="lag"):
        PrefixCaches([(1,)], B, [4], [B], lag_s=-1.0)


def test_a_lagging_index_moves_whole_kv_until_it_learns(profile: Profile) -> None:
    """Requests 2 s apart, each prefill long done before the next arrives: an index that learns
    a change within the gap routes exactly as the exact index (D gets only the KV it lacks); one
    that learns after the run routes as a cache-blind router (every transfer whole)."""
    wl = stream(turns=3, tail=150)
    cfg = {"n_prefill": 2, "n_decode": 1, "p_policy": "cache", "d_policy": "cache"}
    exact = run(profile, wl, **cfg)
    assert run(profile, wl, index_lag_s=0.0, **cfg) == exact
    assert run(profile, wl, index_lag_s=0.5, **cfg)["kv_bytes_moved"] == exact["kv_bytes_moved"]
    late = run(profile, wl, index_lag_s=100.0, **cfg)
    blind = run(profile, wl, cache_aware=False, **cfg)
    assert late["kv_bytes_moved"] == blind["kv_bytes_moved"] > exact["kv_bytes_moved"]
    with pytest.raises(ValueError, match="index_lag_s"):
        SimConfig(index_lag_s=-0.1)
