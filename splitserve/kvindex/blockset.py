"""The exact set of block keys a worker's engine holds, kept from the engine's KV cache events
(pure state: no sockets, no threads; `worker.kvrelay` feeds it and serves what it answers).

vLLM names a cached block by its own hash (`ExternalBlockHash`: sha256 bytes, or an int) and
reports `BlockStored` (consecutive blocks with their token ids and the parent block's hash),
`BlockRemoved` (hashes only) and `AllBlocksCleared`, one batch per engine step. `BlockSet`
translates that into `kvindex.keys` block keys (`block_key(parent_key, block's token ids)`), so
the set it reports depends on token ids only.

What is counted (read from vLLM 0.32's `v1/core/block_pool.py`):
- vLLM's prefix cache maps a hash to *one or more* blocks (two requests that compute the same
  block at the same time each cache their copy), and every (hash, block) entry has its own
  `BlockStored` and `BlockRemoved`. So each hash is counted, and a key is held while any entry
  of any hash keyed to it is.
- Events for another medium than the main cache (`medium` other than None or "GPU", which vLLM
  uses for its main pool on every device) are offload tiers: ignored.
- A block whose hash depends on more than its tokens (`extra_keys`: a LoRA, multimodal inputs, a
  `cache_salt`; or `lora_name`) has no key the router could compute: counted, never reported,
  and neither are the blocks chained after it. So is a block whose parent hash was never seen.
- A second KV cache group (hybrid models: `group_idx` other than 0) or a block size other than
  the configured one makes a prefix hit depend on more than this set: the view is given up.

Exactness: an epoch starts from an empty engine (the engine's start, or `AllBlocksCleared`),
and the set stays exact while every batch of the engine is applied in order. `lose(reason)`
(the relay missed events) and any event that contradicts the view (a removal of a hash never
stored) end the epoch: the set is empty and `exact` False until the engine clears its cache
(vLLM's `reset_prefix_cache`), which starts a new exact epoch. The optional
`kv_cache_report_mode: "full"` of a request (vLLM re-announces cache hits as stores) would be
counted as new entries: keep it off (it is off unless a request asks for it).

Memory (measured by tests/kvindex/test_blockset.py::test_memory_per_block): about 170 bytes per
held block with 32-byte sha256 hashes (vLLM's default; 150-250 as Python's dicts grow by
doubling): the hash itself, the hash -> key map, the key counts. Retired hashes (kept to key
the children of a parent evicted first) cost about as much, at most `retired` of them (default
16,384: under 3 MB). The ring of changes holds at most `ring_keys` keys (default 262,144, at
most 45 bytes each: 12 MB) in at most `ring_changes` changes (default 4,096).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from splitserve.kvindex.keys import ROOT_KEY, block_key
from splitserve.kvindex.messages import KvChange, KvEvents, KvSnapshot

BlockHash = bytes | int  # vLLM's ExternalBlockHash
MAIN_MEDIA = (None, "GPU")  # vLLM's main pool reports "GPU" on every device, CPU included
MAX_CHANGES_PER_ANSWER = 1024


@dataclass(frozen=True)
class Stored:
    """`BlockStored`: consecutive full blocks, the first one's parent hash (None: the first
    block of a sequence), their token ids (`block_size` per block)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group: int | None = None
    medium: str | None = None
    lora: bool = False  # the blocks belong to a LoRA adapter
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (None: tokens only)


@dataclass(frozen=True)
class Removed:
    hashes: tuple[BlockHash, ...]
    group: int | None = None
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    """`AllBlocksCleared`: the engine's prefix cache is empty."""


EngineEvent = Stored | Removed | Cleared


class Gone(Exception):
    """The changes a reader asked for are not available: it must take a new snapshot."""


class _Inconsistent(Exception):
    pass


def new_epoch() -> str:
    return secrets.token_hex(8)


class BlockSet:
    """The keys the engine holds, changes numbered 1, 2, ... within an epoch, a bounded ring."""

    def __init__(self, block_size: int, *, ring_changes: int = 4096, ring_keys: int = 262_144,
                 retired: int = 16_384, clock: Callable[[], float] = time.time,
                 epoch: Callable[[], str] = new_epoch) -> None:
        if block_size < 1 or ring_changes < 1 or ring_keys < 1 or retired < 0:
            raise ValueError("block_size, ring_changes and ring_keys must be positive")
        self.block_size = block_size
        self.ring_changes, self.ring_keys, self.retired_max = ring_changes, ring_keys, retired
        self._clock, self._new_epoch = clock, epoch
        self.epoch = epoch()
        self.seq = 0
        self.exact = True
        self.reason: str | None = None
        self.epochs_lost = 0  # times the view was given up
        self.changes_total = 0
        self._key_of: dict[BlockHash, int | None] = {}  # live hash -> key (None: no key)
        self._dups: dict[BlockHash, int] = {}  # live hash -> entries beyond the first
        self._held: dict[int, int] = {}  # key -> live entries keyed to it
        self._retired: OrderedDict[BlockHash, int | None] = OrderedDict()
        self._ring: deque[KvChange] = deque()
        self._ring_size = 0  # keys in the ring

    # -- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    @property
    def entries(self) -> int:
        """(hash, block) entries of the engine's prefix cache this set counts (keyed or not)."""
        return len(self._key_of) + sum(self._dups.values())

    def snapshot(self) -> KvSnapshot:
        return KvSnapshot(epoch=self.epoch, seq=self.seq, block_size=self.block_size,
                          keys=tuple(self._held), exact=self.exact, reason=self.reason)

    def check_after(self, after: int, epoch: str | None = None) -> None:
        """Raise `Gone` unless the changes after `after` (of `epoch`, when given) can be
        answered: now or, when `after` is the latest, by waiting for the next."""
        if not self.exact:
            raise Gone(f"the view is not exact: {self.reason}")
        if epoch is not None and epoch != self.epoch:
            raise Gone(f"epoch {epoch} is over (now {self.epoch})")
        if after > self.seq:
            raise Gone(f"after={after} is ahead of the latest change {self.seq}")
        oldest = self._ring[0].seq if self._ring else self.seq + 1
        if after < oldest - 1:
            raise Gone(f"changes after {after} are no longer retained (oldest {oldest})")

    def events_after(self, after: int, epoch: str | None = None) -> KvEvents:
        """The retained changes after `after` (at most `MAX_CHANGES_PER_ANSWER`); `Gone` if
        they cannot be answered (see `check_after`)."""
        self.check_after(after, epoch)
        if after == self.seq:
            return KvEvents(epoch=self.epoch, seq=after, block_size=self.block_size)
        start = after - (self._ring[0].seq - 1)
        changes = tuple(islice(self._ring, start, start + MAX_CHANGES_PER_ANSWER))
        return KvEvents(epoch=self.epoch, seq=changes[-1].seq, block_size=self.block_size,
                        changes=changes)

    # -- writing ---------------------------------------------------------------------------

    def lose(self, reason: str) -> None:
        """The view can no longer be vouched for: a new epoch, empty and not exact, until the
        engine clears its cache."""
        if not self.exact:
            return  # already given up: the first reason stands
        self.epochs_lost += 1
        self._restart(exact=False, reason=reason)

    def apply(self, events: Iterable[EngineEvent], ts: float | None = None) -> KvChange | None:
        """Apply one engine batch; return the change it made to the key set (None if none)."""
        prior: dict[int, bool] = {}  # key -> held before this batch (or its last clear)
        cleared = False

        def mark(key: int) -> None:
            if key not in prior:
                prior[key] = key in self._held

        for ev in events:
            if isinstance(ev, Cleared):
                # an empty engine: exact again (a new epoch when the view had been given up)
                self._restart(exact=True, reason=None, new=not self.exact)
                prior.clear()
                cleared = True
                continue
            if not self.exact or ev.medium not in MAIN_MEDIA:
                continue
            if ev.group not in (None, 0):
                self.lose(f"KV cache group {ev.group}: a model with several groups is not "
                          "reported")
                continue  # a later clear in this batch still starts an exact epoch
            try:
                if isinstance(ev, Stored):
                    self._stored(ev, mark)
                else:
                    for h in ev.hashes:
                        self._removed(h, mark)
            except _Inconsistent as exc:
                self.lose(str(exc))
        if not self.exact:
            return None
        stored = tuple(k for k, was in prior.items() if not was and k in self._held)
        removed = tuple(k for k, was in prior.items() if was and k not in self._held)
        if not (stored or removed or (cleared and self.seq > 0)):
            return None
        self.seq += 1
        change = KvChange(seq=self.seq, ts=self._clock() if ts is None else ts, stored=stored,
                          removed=removed, cleared=cleared)
        self._keep(change)
        self.changes_total += 1
        return change

    def _stored(self, ev: Stored, mark: Callable[[int], None]) -> None:
        bs = self.block_size
        if ev.block_size != bs or len(ev.token_ids) != len(ev.hashes) * bs:
            raise _Inconsistent(f"engine stored {len(ev.token_ids)} tokens in "
                                f"{len(ev.hashes)} blocks of {ev.block_size}; this view keys "
                                f"blocks of {bs}")
        parent = ROOT_KEY if ev.parent is None else self._known_key(ev.parent)
        for i, h in enumerate(ev.hashes):
            tokenized = not ev.lora and (ev.extra_keys is None or ev.extra_keys[i] is None)
            key = (block_key(parent, ev.token_ids[i * bs:(i + 1) * bs])
                   if parent is not None and tokenized else None)
            self._store_one(h, key, mark)
            parent = key

    def _known_key(self, h: BlockHash) -> int | None:
        if h in self._key_of:
            return self._key_of[h]
        return self._retired.get(h)

    def _store_one(self, h: BlockHash, key: int | None, mark: Callable[[int], None]) -> None:
        if h not in self._key_of:
            self._key_of[h] = key
            self._retired.pop(h, None)
            if key is not None:
                mark(key)
                self._held[key] = self._held.get(key, 0) + 1
            return
        self._dups[h] = self._dups.get(h, 0) + 1
        old = self._key_of[h]
        if old is None and key is not None:  # its key is known now: every entry counts
            self._key_of[h] = key
            mark(key)
            self._held[key] = self._held.get(key, 0) + 1 + self._dups[h]
        elif old is not None:
            mark(old)
            self._held[old] += 1

    def _removed(self, h: BlockHash, mark: Callable[[int], None]) -> None:
        if h not in self._key_of:
            raise _Inconsistent("engine removed a block this view never saw stored")
        key = self._key_of[h]
        extra = self._dups.get(h, 0)
        if extra > 1:
            self._dups[h] = extra - 1
        elif extra == 1:
            del self._dups[h]
        else:
            del self._key_of[h]
            if self.retired_max:
                self._retired[h] = key
                if len(self._retired) > self.retired_max:
                    self._retired.popitem(last=False)
        if key is not None:
            mark(key)
            n = self._held[key] - 1
            if n:
                self._held[key] = n
            else:
                del self._held[key]

    def _keep(self, change: KvChange) -> None:
        self._ring.append(change)
        self._ring_size += _weight(change)
        while len(self._ring) > 1 and (len(self._ring) > self.ring_changes
                                       or self._ring_size > self.ring_keys):
            self._ring_size -= _weight(self._ring.popleft())

    def _restart(self, *, exact: bool, reason: str | None, new: bool = True) -> None:
        if new:
            self.epoch = self._new_epoch()
            self.seq = 0
            self._ring.clear()
            self._ring_size = 0
        self.exact, self.reason = exact, reason
        self._key_of.clear()
        self._dups.clear()
        self._held.clear()
        self._retired.clear()


def _weight(change: KvChange) -> int:
    return max(1, len(change.stored) + len(change.removed))


def replay(snapshot: KvSnapshot, changes: Sequence[KvChange]) -> set[int]:
    """A reader's view: `snapshot`'s keys with `changes` (those after its seq) applied."""
    keys = set(snapshot.keys)
    for c in changes:
        if c.seq <= snapshot.seq:
            continue
        if c.cleared:
            keys.clear()
        keys.difference_update(c.removed)
        keys.update(c.stored)
    return keys
