"""The exact index (`kvindex.index`): snapshots, changes in order, gaps and epochs, forgetting,
matching prompts against several workers and block sizes, and its memory per block."""

from __future__ import annotations

import gc
import json
import random
import tracemalloc

import pytest

from splitserve.common.wire import WireError
from splitserve.kvindex.index import KvIndex, OutOfSync
from splitserve.kvindex.keys import matched_tokens, prefix_keys
from splitserve.kvindex.messages import KvChange, KvEvents, KvSnapshot

BS = 4


def snap(keys: list[int], seq: int = 0, epoch: str = "e1", bs: int = BS) -> KvSnapshot:
    return KvSnapshot(epoch, seq, bs, tuple(keys))


def events(*changes: KvChange, seq: int | None = None, epoch: str = "e1", bs: int = BS
           ) -> KvEvents:
    last = changes[-1].seq if changes else (seq or 0)
    return KvEvents(epoch, last if seq is None else seq, bs, changes)


def change(seq: int, stored: tuple[int, ...] | list[int] = (),
           removed: tuple[int, ...] | list[int] = (), cleared: bool = False) -> KvChange:
    return KvChange(seq, 0.0, tuple(stored), tuple(removed), cleared)


PROMPT = list(range(100, 118))  # 4 full blocks of 4, and 2 tokens more
KEYS = prefix_keys(PROMPT, BS)


def test_snapshot_then_changes_give_the_exact_set() -> None:
    idx = KvIndex()
    idx.apply_snapshot("a", snap(KEYS[:2], seq=5))
    assert idx.matched(["a"], PROMPT) == {"a": 8}
    idx.apply_events("a", events(change(6, stored=[KEYS[2]]), change(7, stored=[KEYS[3]])))
    assert idx.matched(["a"], PROMPT) == {"a": 16}
    known = idx.worker("a")
    assert known is not None and known.seq == 7
    idx.apply_events("a", events(change(8, removed=[KEYS[1]])))
    assert idx.matched(["a"], PROMPT) == {"a": 4}  # a prefix cache stops at the first miss
    assert idx.keys_of("a") == {KEYS[0], KEYS[2], KEYS[3]} and idx.blocks("a") == 3
    idx.apply_events("a", events(change(9, stored=[KEYS[0]], cleared=True)))
    assert idx.keys_of("a") == {KEYS[0]} and idx.blocks("a") == 1 and len(idx) == 1
    # an empty answer (the long poll timed out) changes nothing
    assert idx.apply_events("a", events(seq=9)) == []


def test_matching_agrees_with_matched_tokens_on_random_sets() -> None:
    rng = random.Random(7)
    idx = KvIndex()
    held: dict[str, set[int]] = {}
    for w in "abcde":
        held[w] = {k for k in KEYS if rng.random() < 0.7}
        idx.apply_snapshot(w, snap(sorted(held[w])))
    got = idx.matched("abcde", keys={BS: KEYS})
    assert got == {w: matched_tokens(KEYS, held[w], BS) for w in "abcde"}
    # reusable: vLLM computes the last prompt token, so a full hit reuses one block less
    full = KvIndex()
    full.apply_snapshot("a", snap(KEYS))
    assert full.matched(["a"], PROMPT[:16]) == {"a": 16}
    assert full.matched(["a"], PROMPT[:16], reusable=15) == {"a": 12}


def test_gap_epoch_and_unknown_worker_are_out_of_sync() -> None:
    idx = KvIndex()
    idx.apply_snapshot("a", snap(KEYS[:1], seq=3))
    with pytest.raises(OutOfSync) as gap:
        idx.apply_events("a", events(change(5, stored=[KEYS[1]])))
    assert gap.value.reason == "gap" and "a" not in idx and len(idx) == 0
    idx.apply_snapshot("a", snap(KEYS[:1], seq=3))
    with pytest.raises(OutOfSync) as newer:  # the worker is ahead with nothing sent: a gap
        idx.apply_events("a", events(seq=4))
    assert newer.value.reason == "gap"
    idx.apply_snapshot("a", snap(KEYS[:1], seq=3))
    with pytest.raises(OutOfSync) as epoch:
        idx.apply_events("a", events(change(4), epoch="e2"))
    assert epoch.value.reason == "epoch" and "a" not in idx
    with pytest.raises(OutOfSync) as unknown:
        idx.apply_events("b", events(change(1)))
    assert unknown.value.reason == "unknown"
    # changes already applied (an answer overlapping the view) are skipped, not applied twice
    idx.apply_snapshot("a", snap(KEYS[:2], seq=3))
    applied = idx.apply_events("a", events(change(3, removed=[KEYS[0]]), change(4)))
    assert [c.seq for c in applied] == [4] and idx.blocks("a") == 2


def test_forget_leaves_other_workers_and_reuses_the_slot() -> None:
    idx = KvIndex()
    idx.apply_snapshot("a", snap(KEYS))
    idx.apply_snapshot("b", snap(KEYS[:2]))
    assert len(idx) == 4
    idx.forget("a")
    assert "a" not in idx and idx.matched(["a", "b"], PROMPT) == {"b": 8} and len(idx) == 2
    idx.apply_snapshot("c", snap(KEYS[:1]))  # takes a's slot: none of a's bits remain
    assert idx.matched(["b", "c"], PROMPT) == {"b": 8, "c": 4}
    assert idx.keys_of("c") == {KEYS[0]}
    idx.forget("nobody")  # a no-op


def test_workers_of_different_block_sizes() -> None:
    idx = KvIndex()
    idx.apply_snapshot("small", snap(prefix_keys(PROMPT, 2)[:5], bs=2))
    idx.apply_snapshot("big", snap(KEYS[:3]))
    keys = idx.prompt_keys(PROMPT)
    assert set(keys) == {2, 4}
    assert idx.matched(["small", "big", "absent"], keys=keys) == {"small": 10, "big": 12}
    with pytest.raises(ValueError):
        idx.matched(["small"], keys={4: KEYS})
    # a new block size comes with a new epoch's snapshot, never within a stream
    with pytest.raises(OutOfSync):
        idx.apply_events("big", events(change(1), bs=8))


def test_memory_per_block() -> None:
    """The documented bound: under 100 bytes per distinct block (88 measured, CPython 3.11),
    nothing more for a second worker holding the same blocks."""
    n = 20_000
    rng = random.Random(1)
    raw = json.dumps({"epoch": "e", "seq": 0, "block_size": 128,
                      "keys": [rng.getrandbits(64) for _ in range(n)]})
    idx = KvIndex()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        idx.apply_snapshot("a", KvSnapshot.from_json(json.loads(raw)))
        gc.collect()
        one = tracemalloc.get_traced_memory()[0] - base
        idx.apply_snapshot("b", KvSnapshot.from_json(json.loads(raw)))
        gc.collect()
        two = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert one / n < 100, one / n
    assert (two - one) / n < 2, (two - one) / n


@pytest.mark.parametrize("bad", [{"ts": 10**400}, {"ts": float("inf")}, {"ts": float("nan")},
                                 {"ts": 2e12}, {"ts": "1"}, {"ts": True}, {"seq": -1},
                                 {"cleared": 1}, {"stored": [2**64]}, {"removed": [True]}])
def test_a_change_out_of_shape_is_a_wire_error(bad: dict[str, object]) -> None:
    """Whatever a worker's change holds, reading it raises WireError (a ValueError the
    router's follower handles as a lost view) or gives a valid change; never another error."""
    good = {"seq": 1, "ts": 1.7e9, "stored": [1, 2], "removed": [3], "cleared": False}
    assert KvChange.from_json(good) == KvChange(1, 1.7e9, (1, 2), (3,), False)
    with pytest.raises(WireError):
        KvChange.from_json(good | bad)
