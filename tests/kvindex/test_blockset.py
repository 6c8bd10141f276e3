"""The worker's view of its engine's prefix cache (`kvindex.blockset.BlockSet`): vLLM's events in,
block keys and numbered changes out, exact or given up, in bounded memory."""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from typing import Any

import pytest

from splitserve.kvindex.blockset import (
    BlockSet,
    Cleared,
    EngineEvent,
    Gone,
    Removed,
    Stored,
    replay,
)
from splitserve.kvindex.keys import prefix_keys

BS = 4


def vhash(tokens: list[int], salt: str = "") -> bytes:
    """A stand-in for vLLM's block hash: sha256 of the prefix (32 bytes, as vLLM's default)."""
    return hashlib.sha256(repr((salt, tokens)).encode()).digest()


def stored(tokens: list[int], start_block: int = 0, n: int | None = None, salt: str = "",
           **kw: Any) -> Stored:
    """vLLM's BlockStored for blocks start_block.. of `tokens` (parent: the block before)."""
    full = len(tokens) // BS
    end = full if n is None else start_block + n
    hashes = tuple(vhash(tokens[:(i + 1) * BS], salt) for i in range(start_block, end))
    parent = vhash(tokens[:start_block * BS], salt) if start_block else None
    return Stored(hashes=hashes, parent=parent, token_ids=tuple(tokens[start_block * BS:end * BS]),
                  block_size=BS, group=0, medium="GPU", **kw)


def removed(tokens: list[int], *blocks: int, salt: str = "") -> Removed:
    return Removed(tuple(vhash(tokens[:(i + 1) * BS], salt) for i in blocks), 0, "GPU")


A = list(range(100, 112))  # 3 blocks
B = A[:4] + list(range(200, 208))  # shares A's first block


def test_stored_chain_is_keyed_from_token_ids_and_numbered() -> None:
    s = BlockSet(BS)
    change = s.apply([stored(A)], ts=5.0)
    assert change is not None and change.seq == 1 and change.ts == 5.0
    assert set(change.stored) == set(prefix_keys(A, BS)) and not change.removed
    snap = s.snapshot()
    assert snap.exact and snap.seq == 1 and snap.block_size == BS
    assert set(snap.keys) == set(prefix_keys(A, BS))


def test_a_continuation_chains_from_its_parent_hash() -> None:
    s = BlockSet(BS)
    s.apply([stored(A, 0, 1)])
    change = s.apply([stored(A, 1, 2)])
    assert change is not None and set(change.stored) == set(prefix_keys(A, BS)[1:])
    s.apply([stored(B, 1)])  # B's own blocks after the shared first one
    assert set(s.snapshot().keys) == set(prefix_keys(A, BS)) | set(prefix_keys(B, BS))


def test_removals_and_clear() -> None:
    s = BlockSet(BS)
    s.apply([stored(A)])
    change = s.apply([removed(A, 2)])
    assert change is not None and change.removed == (prefix_keys(A, BS)[2],)
    change = s.apply([Cleared()])
    assert change is not None and change.cleared and len(s) == 0 and s.exact
    assert s.snapshot().seq == 3  # a clear in an exact epoch is a change of that epoch


def test_a_batch_reports_its_net_change() -> None:
    s = BlockSet(BS)
    assert s.apply([stored(A), removed(A, 0, 1, 2)]) is None
    change = s.apply([stored(A), Cleared(), stored(B)])
    assert change is not None and change.cleared and not change.removed
    assert set(change.stored) == set(prefix_keys(B, BS))


def test_a_hash_cached_in_two_blocks_is_held_until_both_go() -> None:
    s = BlockSet(BS)
    s.apply([stored(A)])
    assert s.apply([stored(A, 0, 1)]) is None  # a second request computed block 0 meanwhile
    assert s.apply([removed(A, 0)]) is None
    assert prefix_keys(A, BS)[0] in s
    change = s.apply([removed(A, 0)])
    assert change is not None and change.removed == (prefix_keys(A, BS)[0],)


def test_blocks_without_a_token_key_are_counted_never_reported() -> None:
    s = BlockSet(BS)
    # a salted first block (cache_salt) and the blocks chained after it
    assert s.apply([stored(A, salt="s", extra_keys=(("salt",), None, None))]) is None
    assert s.apply([stored(B, salt="lora", lora=True)]) is None
    assert len(s) == 0 and s.entries == 6
    assert s.apply([removed(A, 0, 1, 2, salt="s")]) is None and s.exact and s.entries == 3


def test_a_block_whose_parent_was_never_seen_is_not_reported() -> None:
    s = BlockSet(BS)
    assert s.apply([stored(A, 1)]) is None and s.entries == 2 and len(s) == 0
    # the same hash stored again under a known parent: its key is known now, both entries count
    s.apply([stored(A, 0, 1)])
    change = s.apply([stored(A, 1, 1)])
    assert change is not None and change.stored == (prefix_keys(A, BS)[1],)
    s.apply([removed(A, 1)])
    assert prefix_keys(A, BS)[1] in s
    s.apply([removed(A, 1)])
    assert prefix_keys(A, BS)[1] not in s


def test_a_child_stored_after_its_parent_was_evicted_is_keyed() -> None:
    s = BlockSet(BS)
    s.apply([stored(A, 0, 2)])
    s.apply([removed(A, 0, 1)])  # e.g. failed loads evicted while the request ran on
    change = s.apply([stored(A, 2)])
    assert change is not None and change.stored == (prefix_keys(A, BS)[2],)


def test_other_media_are_ignored() -> None:
    s = BlockSet(BS)
    cpu = Stored(hashes=(b"x" * 32,), parent=None, token_ids=(1, 2, 3, 4), block_size=BS,
                 group=0, medium="CPU")
    assert s.apply([cpu, Removed((b"y" * 32,), 0, "CPU")]) is None and s.exact


@pytest.mark.parametrize("bad", [
    Removed((b"never" * 8,), 0, "GPU"),  # a removal of a block never stored
    Stored(hashes=(b"x" * 32,), parent=None, token_ids=(1, 2), block_size=2, group=0),
    Stored(hashes=(b"x" * 32,), parent=None, token_ids=(1, 2, 3, 4), block_size=BS, group=1),
])
def test_a_contradiction_gives_the_view_up_until_the_engine_clears(bad: EngineEvent) -> None:
    s = BlockSet(BS)
    s.apply([stored(A)])
    epoch = s.epoch
    assert s.apply([bad]) is None
    snap = s.snapshot()
    assert not snap.exact and snap.keys == () and snap.reason and snap.epoch != epoch
    assert s.epochs_lost == 1
    with pytest.raises(Gone):
        s.events_after(0)
    assert s.apply([stored(B)]) is None and len(s) == 0  # ignored while given up
    s.apply([stored(B), Cleared(), stored(A)])
    snap = s.snapshot()
    assert snap.exact and snap.epoch not in (epoch,) and snap.seq == 1
    assert set(snap.keys) == set(prefix_keys(A, BS))
    # the contradiction and the engine's clear in one batch: exact again from the clear on
    s.apply([bad, stored(B), Cleared(), stored(A)])
    snap = s.snapshot()
    assert snap.exact and set(snap.keys) == set(prefix_keys(A, BS))


def test_lose_says_why_and_starts_a_new_epoch() -> None:
    s = BlockSet(BS)
    s.apply([stored(A)])
    before = s.epoch
    s.lose("lost engine batches 3..4")
    s.lose("again")
    snap = s.snapshot()
    assert (snap.exact, snap.reason, snap.keys, s.epochs_lost) == (
        False, "lost engine batches 3..4", (), 1)
    assert snap.epoch != before


def test_events_after_answers_consecutive_changes_or_gone() -> None:
    s = BlockSet(BS)
    s.apply([stored(A, 0, 1)])
    s.apply([stored(A, 1, 1)])
    s.apply([stored(A, 2, 1)])
    ev = s.events_after(1)
    assert [c.seq for c in ev.changes] == [2, 3] and ev.seq == 3 and ev.epoch == s.epoch
    assert s.events_after(3).changes == () and s.events_after(3).seq == 3
    with pytest.raises(Gone, match="ahead"):
        s.events_after(4)
    with pytest.raises(Gone, match="epoch"):
        s.events_after(1, epoch="another")


def test_the_ring_is_bounded_and_a_reader_behind_it_gets_gone() -> None:
    s = BlockSet(BS, ring_changes=3, ring_keys=1000)
    tokens = list(range(40))
    for i in range(10):
        s.apply([stored(tokens, i, 1)])
    with pytest.raises(Gone, match="no longer retained"):
        s.events_after(6)
    assert [c.seq for c in s.events_after(7).changes] == [8, 9, 10]
    t = BlockSet(BS, ring_changes=100, ring_keys=5)  # bounded by keys too
    t.apply([stored(tokens)])  # one change of 10 keys: kept (the latest always is)
    t.apply([removed(tokens, 9)])
    assert [c.seq for c in t.events_after(1).changes] == [2]
    with pytest.raises(Gone):
        t.events_after(0)


def test_a_snapshot_and_the_changes_after_it_are_the_exact_set() -> None:
    """The contract, against a model engine: random stores (with duplicates, shared prefixes),
    evictions and clears; a reader's snapshot + changes equals the keys of what is cached."""
    rng = random.Random(7)
    s = BlockSet(BS, ring_changes=10_000)
    cached: list[tuple[tuple[int, ...], int]] = []  # (prefix, its key) per (hash, block) entry
    snaps = []
    for step in range(300):
        batch: list[EngineEvent] = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.55:
                seq = [rng.randint(0, 3) for _ in range(BS * rng.randint(1, 4))]
                keys = prefix_keys(seq, BS)
                start = rng.randint(0, len(keys) - 1)
                # vLLM stores a continuation only when its parent is cached
                if start and all(k != keys[start - 1] for _, k in cached):
                    start = 0
                batch.append(stored(seq, start))
                cached += [(tuple(seq[:(i + 1) * BS]), keys[i]) for i in range(start, len(keys))]
            elif r < 0.97 and cached:
                victim, _ = cached.pop(rng.randrange(len(cached)))
                batch.append(Removed((vhash(list(victim)),), 0, "GPU"))
            elif r >= 0.97:
                batch.append(Cleared())
                cached.clear()
        s.apply(batch)
        if step % 50 == 0:
            snaps.append(s.snapshot())
        assert set(s.snapshot().keys) == {k for _, k in cached}
    assert s.exact
    for snap in snaps:
        assert replay(snap, s.events_after(snap.seq).changes) == set(s.snapshot().keys)


def test_memory_per_block() -> None:
    """What the docstring of kvindex.blockset states (bytes per held block, sha256 hashes)."""
    tokens = list(range(BS * 20_000))
    s = BlockSet(BS, ring_changes=1, ring_keys=1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    # the hashes are made here, as the relay's decoder makes them
    ev = Stored(hashes=tuple(random.randbytes(32) for _ in range(len(tokens) // BS)),
                parent=None, token_ids=tuple(tokens), block_size=BS, group=0, medium="GPU")
    s.apply([ev])
    del ev
    per_block = (tracemalloc.get_traced_memory()[0] - base) / len(s)
    tracemalloc.stop()
    print(f"{per_block:.0f} bytes per held block")
    assert 120 < per_block < 300
