"""The simulator workload's prefix identity: a Mooncake replay's arrays equal the benchmark's
stream request for request (lengths, arrivals, equal keys exactly where the prompts' blocks are
equal), sampling keeps whole prefix trees, multi-turn follow-ups share their earlier turn's full
blocks, and `SimWorkload` refuses keys that do not fit the prompt lengths."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitserve.bench.mooncake import TraceRow, TraceShape, make_trace, write_mooncake
from splitserve.bench.repeat import MooncakeOptions, MultiturnOptions, round_half_up
from splitserve.bench.workload import Request, WorkloadSpec, build_stream
from splitserve.sim.workload import SimWorkload, arrays_from_spec, from_requests, prefix_keys

BLOCK = 64  # the generated trace's hash-block size


def _trace(path: Path) -> Path:
    """A small generated conversation trace plus two rows without hash ids."""
    shape = TraceShape(sessions=12, max_turns=4, session_rate=2.0, think_s=3.0, user_min=40,
                       user_max=300, output_min=8, output_max=64, block_tokens=BLOCK)
    rows = make_trace(shape, seed=1)
    rows += [TraceRow(rows[3].timestamp_ms + 1.0, 150, 7), TraceRow(rows[-1].timestamp_ms, 20, 3)]
    return write_mooncake(sorted(rows, key=lambda r: r.timestamp_ms), path)


def _spec(path: Path, **opts: Any) -> WorkloadSpec:
    return WorkloadSpec(source="mooncake", path=str(path), seed=5,
                        mooncake=MooncakeOptions(block_tokens=BLOCK, **opts))


def _block(prompt: tuple[int, ...], k: int, b: int) -> tuple[int, ...]:
    """The prompt up to and including block k (what key k names)."""
    return prompt[:min((k + 1) * b, len(prompt))]


def _assert_keys_name_prefixes(wl: SimWorkload, reqs: list[Request]) -> None:
    assert wl.blocks is not None
    b = wl.block_tokens
    for i, j in combinations(range(len(reqs)), 2):
        pi, pj = reqs[i].prompt_token_ids, reqs[j].prompt_token_ids
        for k in range(min(len(wl.blocks[i]), len(wl.blocks[j]))):
            same_key = wl.blocks[i][k] == wl.blocks[j][k]
            assert same_key == (_block(pi, k, b) == _block(pj, k, b)), (i, j, k)


@pytest.mark.parametrize("opts", [
    {},
    {"token_scale": 0.5, "time_scale": 2.0, "max_requests": 25},
    {"token_scale": 0.3, "sample_sessions": 0.5},
])
def test_mooncake_arrays_are_the_benchmark_stream(tmp_path: Path,
                                                  opts: dict[str, Any]) -> None:
    spec = _spec(_trace(tmp_path / "t.jsonl"), **opts)
    wl, reqs = arrays_from_spec(spec, block_tokens=7), build_stream(spec)  # 7: ignored here
    assert len(wl) == len(reqs) > 0
    assert wl.arrivals.tolist() == [r.arrival_s for r in reqs]
    assert wl.prompt_lens.tolist() == [r.input_len for r in reqs]
    assert wl.output_lens.tolist() == [r.output_len for r in reqs]
    assert wl.block_tokens == spec.mooncake.scaled_block_tokens
    assert wl.blocks is not None
    for keys, r in zip(wl.blocks, reqs, strict=True):
        if r.hash_ids:
            assert keys == r.hash_ids
        else:  # fresh keys: negative, and no other block anywhere has them
            assert keys and all(k < 0 for k in keys)
            assert sum(Counter(k for ks in wl.blocks for k in ks)[k] for k in keys) == len(keys)
    assert max(Counter(k for ks in wl.blocks for k in ks).values()) > 1  # prefixes repeat
    if "max_requests" not in opts:
        assert sum(not r.hash_ids for r in reqs) >= 1  # the test covers rows without ids
    _assert_keys_name_prefixes(wl, reqs)


def test_sample_sessions_keeps_whole_prefix_trees(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t.jsonl")
    everything, every_req = arrays_from_spec(_spec(path)), build_stream(_spec(path))
    sampled = _spec(path, sample_sessions=0.5)
    kept, kept_req = arrays_from_spec(sampled), build_stream(sampled)
    trees = {r.session for r in kept_req}
    # the replay's rule: round(fraction × trees), at least 1, of the trace's trees
    assert len(trees) == max(1, round_half_up(0.5 * len({r.session for r in every_req})))
    assert len(trees) > 1  # the trace has enough trees that sampling leaves some out
    assert everything.blocks is not None and kept.blocks is not None
    whole = [i for i, r in enumerate(every_req) if r.session in trees]
    assert len(kept) == len(whole)  # every request of a chosen tree, nothing else
    assert list(kept.blocks) == [everything.blocks[i] for i in whole]
    assert kept.prompt_lens.tolist() == everything.prompt_lens[whole].tolist()
    t0 = everything.arrivals[whole[0]]
    np.testing.assert_allclose(kept.arrivals, everything.arrivals[whole] - t0)


def test_multiturn_follow_ups_share_the_earlier_turns_full_blocks() -> None:
    mt = MultiturnOptions(sessions=3, turns=3, system_tokens=100, user_tokens=20,
                          output_tokens=30, think_time_s=0.5)
    spec = WorkloadSpec(source="multiturn", multiturn=mt, seed=2)
    b = 16
    wl, reqs = arrays_from_spec(spec, block_tokens=b), build_stream(spec)
    assert wl.blocks is not None and wl.block_tokens == b
    assert wl.prompt_lens.tolist() == [r.input_len for r in reqs]
    turns = {(r.session, r.turn): keys for r, keys in zip(reqs, wl.blocks, strict=True)}
    for s in range(mt.sessions):
        for k in range(mt.turns - 1):
            earlier, later = turns[(s, k)], turns[(s, k + 1)]
            full = (mt.system_tokens + k * (mt.user_tokens + mt.output_tokens)
                    + mt.user_tokens) // b
            assert later[:full] == earlier[:full]  # the earlier prompt's full blocks
            assert not set(later[full:]) & set(earlier)  # its partial block and beyond differ
    system = mt.system_tokens // b  # the shared system prompt's full blocks
    firsts = [turns[(s, 0)] for s in range(mt.sessions)]
    assert all(f[:system] == firsts[0][:system] for f in firsts)
    assert len({f[system] for f in firsts}) == mt.sessions
    _assert_keys_name_prefixes(wl, reqs)


def test_synthetic_has_no_prefix_identity() -> None:
    wl = arrays_from_spec(WorkloadSpec(num_requests=5))
    assert wl.blocks is None and len(wl) == 5
    with pytest.raises(ValueError, match="block_tokens"):
        arrays_from_spec(WorkloadSpec(num_requests=5), block_tokens=0)


def test_prefix_keys_and_from_requests() -> None:
    a = tuple(range(40))
    keys = prefix_keys(a, 16)
    assert len(keys) == 3 and prefix_keys(a[:32], 16) == keys[:2]
    assert prefix_keys(a[:36], 16)[2] != keys[2]  # a partial block is not its full block
    assert prefix_keys((99,) + a[1:], 16)[1] != keys[1]  # a key names the whole prefix
    reqs = [Request(0, 1.0, a, 4), Request(1, 0.5, a[:20], 2)]
    wl = from_requests(reqs, block_tokens=16)
    assert wl.arrivals.tolist() == [0.5, 1.0] and wl.blocks == (prefix_keys(a[:20], 16), keys)
    assert wl.block_tokens == 16 and prefix_keys(a[:20], 16)[0] == keys[0]
    assert from_requests(reqs).blocks is None

    @dataclass
    class Bare:
        arrival_s: float
        input_len: int
        output_len: int

    assert from_requests([Bare(0.0, 10, 2)], block_tokens=16).blocks is None


def test_simworkload_rejects_a_wrong_block_count() -> None:
    arrays = (np.array([0.0, 1.0]), np.array([130, 128]), np.array([1, 1]))
    ok = SimWorkload(*arrays, blocks=((1, 2), (1,)), block_tokens=128)
    assert ok.blocks == ((1, 2), (1,))
    with pytest.raises(ValueError, match="request 1: 128 prompt tokens are 1 blocks"):
        SimWorkload(*arrays, blocks=((1, 2), (1, 3)), block_tokens=128)
    with pytest.raises(ValueError, match="one entry per request"):
        SimWorkload(*arrays, blocks=((1, 2),), block_tokens=128)
    with pytest.raises(ValueError, match="block_tokens >= 1"):
        SimWorkload(*arrays, blocks=((1, 2), (1,)), block_tokens=0)


def _stream(n: int, gap: float) -> SimWorkload:
    keys = tuple((i % 3, i) for i in range(n))  # requests share their first block by threes
    return SimWorkload(np.arange(n) * gap + 5.0, np.full(n, 20, dtype=np.int64),
                       np.arange(1, n + 1, dtype=np.int64),
                       tuple((hash(k[:1]), hash(k)) for k in keys), 16)


def test_at_rate_holds_the_duration_not_the_count() -> None:
    wl = _stream(10, 0.5)  # 2 req/s over 5 s (a gap included)
    same = wl.at_rate(2.0)
    assert np.allclose(same.arrivals, wl.arrivals) and same.blocks == wl.blocks
    slow = wl.at_rate(1.0)  # 5 s at 1 req/s: the first 5 requests, 1 s apart
    assert np.allclose(slow.arrivals, 5.0 + np.arange(5)) and slow.blocks == wl.blocks[:5]
    fast = wl.at_rate(5.0)  # 5 s at 5 req/s: 25 requests, the stream 2.5 times
    assert len(fast) == 25
    assert np.allclose(fast.arrivals, 5.0 + np.arange(25) * 0.2)
    assert fast.output_lens.tolist() == (list(range(1, 11)) * 3)[:25]
    assert fast.blocks is not None and fast.blocks[:10] == wl.blocks
    first_copy = {k for keys in fast.blocks[:10] for k in keys}
    second_copy = {k for keys in fast.blocks[10:20] for k in keys}
    assert not first_copy & second_copy  # a copy is other users: no shared prefix
    # within a copy the sharing is the original's: requests 10 and 13 share their first block
    assert fast.blocks[10][0] == fast.blocks[13][0] != fast.blocks[11][0]


def test_at_rate_from_a_nominal_base_and_refusals() -> None:
    wl = _stream(4, 1.0)
    assert len(wl.at_rate(0.01, base=1.0)) == 1  # never empty
    assert len(wl.at_rate(3.0, base=1.0)) == 12
    with pytest.raises(ValueError, match="positive"):
        wl.at_rate(0.0)
