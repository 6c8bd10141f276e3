"""The exact index: which prefix blocks each worker's engine holds, as its cache report says
(`messages`: a snapshot, then every change after it, in order). Pure: no router or simulator
import, no I/O, no clock; the router's `router.cacheview` feeds it, the simulator may too.

Layout and memory. One dict maps each block key (`keys.prefix_keys`) to a bitmask of the
workers holding it (bit = the worker's slot); a worker's own record keeps its slot, block size,
epoch, last applied change and block count. A block held by several workers is stored once.
Measured with tracemalloc (`tests/kvindex/test_index.py::test_memory_per_block`,
`benchmarks/kvindex_memory.py`; CPython 3.11, 64-bit): 88 bytes per distinct block (the
key's int object and the dict's entry and index at its load factor), and nothing more for a
second worker holding the same block (masks of up to 8 workers are CPython's cached small
ints). The index never holds more blocks than its workers' engines do: its size is bounded by
the sum of their KV caches in blocks (one 128-token block of the demo model is ~1 MiB of KV
on the worker, 88 B here).

Costs: storing or removing a block, O(1); `matched`, one dict lookup per prompt block for all
workers of one block size together; `forget` (and `apply_snapshot`, which forgets first, and a
change with `cleared`), one pass over the dict: O(blocks held by every worker), 12 ms per
100,000 blocks here on a quiet machine; rare (a restart, a resync, a removal). Keying a
4,096-token prompt in 128-token blocks: ~0.12 ms; matching it against 4 workers: ~3 us.

Order. `apply_snapshot` replaces what was known of a worker; `apply_events` applies changes of
the snapshot's epoch whose sequence numbers continue it exactly, else raises `OutOfSync`, and
the caller takes a new snapshot (its view meanwhile forgotten). A worker without a snapshot is
not in the index: `matched` leaves it out (its cached tokens are unknown, not zero).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from splitserve.kvindex.keys import prefix_keys
from splitserve.kvindex.messages import KvChange, KvEvents, KvSnapshot

# Keys per block size, as `prompt_keys` computes them once per request.
PromptKeys = Mapping[int, Sequence[int]]


class OutOfSync(Exception):
    """The changes do not continue the worker's view (another epoch, a sequence gap, or no
    snapshot yet): take a new snapshot. `reason`: `epoch`, `gap` or `unknown`."""

    def __init__(self, worker: str, reason: str, detail: str) -> None:
        super().__init__(f"{worker}: {reason}: {detail}")
        self.worker = worker
        self.reason = reason


@dataclass
class WorkerCache:
    """What the index knows of one worker's cache."""

    slot: int
    block_size: int
    epoch: str
    seq: int  # the last change applied
    blocks: int = 0  # keys held (exact: counted on every store and removal)


class KvIndex:
    """Per worker (by id: the router uses its URL), the set of block keys its engine holds."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block key -> bitmask of worker slots
        self._workers: dict[str, WorkerCache] = {}
        self._free: list[int] = []  # slots given back by `forget`, reused lowest first
        self._next_slot = 0

    # --- reading --------------------------------------------------------------------------
    def __contains__(self, worker: object) -> bool:
        return worker in self._workers

    def __len__(self) -> int:
        """Distinct blocks held by any worker."""
        return len(self._holders)

    def worker(self, worker: str) -> WorkerCache | None:
        return self._workers.get(worker)

    def workers(self) -> list[str]:
        return list(self._workers)

    def blocks(self, worker: str) -> int:
        known = self._workers.get(worker)
        return 0 if known is None else known.blocks

    def holds(self, worker: str, key: int) -> bool:
        known = self._workers.get(worker)
        return known is not None and bool(self._holders.get(key, 0) >> known.slot & 1)

    def keys_of(self, worker: str) -> set[int]:
        """Every key `worker` holds (a pass over the index: for tests and checks)."""
        known = self._workers.get(worker)
        if known is None:
            return set()
        bit = 1 << known.slot
        return {k for k, mask in self._holders.items() if mask & bit}

    def block_sizes(self) -> set[int]:
        return {w.block_size for w in self._workers.values()}

    def prompt_keys(self, token_ids: Sequence[int]) -> dict[int, list[int]]:
        """The prompt's block keys for every block size in use (compute once per request)."""
        return {bs: prefix_keys(token_ids, bs) for bs in self.block_sizes()}

    def matched(self, workers: Iterable[str], token_ids: Sequence[int] | None = None,
                keys: PromptKeys | None = None, reusable: int | None = None) -> dict[str, int]:
        """Tokens of the prompt each of `workers` holds as a cached prefix (a multiple of its
        block size), from `token_ids` or their precomputed `keys`; with `reusable`, at most the
        largest multiple of its block size not above it (vLLM reuses at most the prompt less
        its last token: pass `len(prompt) - 1`). Workers not in the index are left out."""
        by_size: dict[int, list[tuple[str, WorkerCache]]] = {}
        for w in workers:
            known = self._workers.get(w)
            if known is not None:
                by_size.setdefault(known.block_size, []).append((w, known))
        out: dict[str, int] = {}
        for bs, group in by_size.items():
            if keys is not None and bs in keys:
                ks: Sequence[int] = keys[bs]
            elif token_ids is not None:
                ks = prefix_keys(token_ids, bs)
            else:
                raise ValueError(f"no keys of block size {bs} and no token ids")
            run = self._runs(ks, [c.slot for _, c in group])
            cap = None if reusable is None else max(reusable, 0) // bs
            for (w, _), n in zip(group, run, strict=True):
                out[w] = (n if cap is None else min(n, cap)) * bs
        return out

    def _runs(self, keys: Sequence[int], slots: list[int]) -> list[int]:
        """For each slot, how many of `keys` from the first it holds without a miss."""
        want = 0
        for s in slots:
            want |= 1 << s
        live, n, runs = want, 0, {s: 0 for s in slots}
        get = self._holders.get
        for key in keys:
            mask = get(key, 0) & live
            if mask != live:  # some workers miss here: their runs end at n
                for s in slots:
                    if live >> s & 1 and not mask >> s & 1:
                        runs[s] = n
                live = mask
            n += 1
            if not live:
                break
        for s in slots:
            if live >> s & 1:
                runs[s] = n
        return [runs[s] for s in slots]

    # --- writing --------------------------------------------------------------------------
    def apply_snapshot(self, worker: str, snap: KvSnapshot) -> None:
        """Replace what is known of `worker` with `snap` (its epoch, seq and keys)."""
        self.forget(worker)
        slot = self._free.pop(0) if self._free else self._take_slot()
        known = self._workers[worker] = WorkerCache(slot, snap.block_size, snap.epoch, snap.seq)
        self._store(known, snap.keys)

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def apply_events(self, worker: str, events: KvEvents) -> list[KvChange]:
        """Apply `events` (the answer to a read after the worker's last change): its changes
        must continue the worker's view exactly. Returns the changes applied. `OutOfSync` (the
        view is then forgotten) on another epoch or block size, a gap, or no view."""
        known = self._workers.get(worker)
        if known is None:
            raise OutOfSync(worker, "unknown", "no snapshot applied")
        if events.epoch != known.epoch or events.block_size != known.block_size:
            self.forget(worker)
            raise OutOfSync(worker, "epoch", f"{known.epoch} -> {events.epoch}")
        changes = [c for c in events.changes if c.seq > known.seq]
        first = changes[0].seq if changes else events.seq
        if (changes and first != known.seq + 1) or (not changes and events.seq > known.seq):
            self.forget(worker)
            raise OutOfSync(worker, "gap", f"after {known.seq} came {first}")
        for change in changes:
            self.apply_change(worker, change)
        return changes

    def apply_change(self, worker: str, change: KvChange) -> None:
        """Apply one change (`cleared`, then `removed`, then `stored`) and take its seq; the
        caller checks its order (`apply_events` does)."""
        known = self._workers[worker]
        if change.cleared:
            self._drop(known)
        bit = 1 << known.slot
        holders = self._holders
        for key in change.removed:
            mask = holders.get(key, 0)
            if mask & bit:
                known.blocks -= 1
                if mask == bit:
                    del holders[key]
                else:
                    holders[key] = mask & ~bit
        self._store(known, change.stored)
        known.seq = change.seq

    def _store(self, known: WorkerCache, keys: Iterable[int]) -> None:
        bit = 1 << known.slot
        holders = self._holders
        for key in keys:
            mask = holders.get(key, 0)
            if not mask & bit:
                holders[key] = mask | bit
                known.blocks += 1

    def forget(self, worker: str) -> None:
        """Drop everything known of `worker` (removed, restarted, or its stream lost)."""
        known = self._workers.pop(worker, None)
        if known is not None:
            self._drop(known)
            self._free.append(known.slot)
            self._free.sort()

    def _drop(self, known: WorkerCache) -> None:
        """Clear `known`'s bit from every key (one pass)."""
        if not known.blocks:
            return
        bit = 1 << known.slot
        holders = self._holders
        gone = []
        for key, mask in holders.items():
            if mask & bit:
                if mask == bit:
                    gone.append(key)
                else:
                    holders[key] = mask & ~bit
        for key in gone:
            del holders[key]
        known.blocks = 0
