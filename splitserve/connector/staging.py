"""D's staging area: one owner-only shared-memory segment, carved into per-transfer regions.

Contract (the swap point between transports and the loader):
- `begin` reserves a region for a whole transfer or refuses (full, duplicate, too large) before
  any KV moves; P never stalls mid-prefill on a D that cannot take the transfer. A transfer
  holds the prompt tokens [skip, num_tokens): the prefix P skipped is never staged, and a load
  that would need it fails (`decode_load`).
- A region is written only by its transfer's connection (tcp: `recv_into`; shm: P's memcpy),
  and read only by the loader after the transfer is `complete` (every layer of every token
  received and its checksum verified, and the END marker seen).
- Every region is freed exactly once, when both its writer is done (END, ABORT or the connection
  dropped) and its reader is done (loaded into vLLM's blocks, given up on, failed while
  unclaimed, or its lease expired with no decode request claiming it). The reaper scans every
  entry, not just the oldest.
- The lease (`lease_s`) bounds KV that is complete and unclaimed: it runs from the END. A
  transfer still being written is never reaped, however long its prefill: its connection
  bounds it (a writer that goes away, even silently, fails it; P ABORTs what it gives up).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

from splitserve.common.vocab import TransferStatus
from splitserve.connector.donetable import DoneTable
from splitserve.connector.layout.staging_format import KVShape
from splitserve.connector.ranks import RankHeads, transfer_of
from splitserve.connector.segment import SharedSegment
from splitserve.connector.stats import ConnectorStats, TransferRecord

ALIGN = 4096


class StagingRefused(Exception):
    """D cannot stage this transfer; `cause` is a short machine-readable reason."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class RegionAllocator:
    """First-fit allocator of aligned byte ranges; not thread-safe (StagingArea locks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size)

    def alloc(self, size: int) -> int | None:
        size = -(-size // ALIGN) * ALIGN
        for i, (off, avail) in enumerate(self._free):
            if avail >= size:
                rest = (off + size, avail - size)
                self._free[i:i + 1] = [rest] if rest[1] else []
                return off
        return None

    def free(self, off: int, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        self._free.append((off, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(s for _, s in self._free)


@dataclass
class StagedTransfer:
    transfer_id: str
    num_tokens: int  # the prompt's length: the transfer ends there
    offset: int
    nbytes: int
    record: TransferRecord
    lease_deadline: float
    shape: KVShape  # of the heads staged: the rank's, or a piece's (`connector.ranks`)
    tokens_per_layer: list[int] = field(default_factory=list)
    chunks: dict[int, int] = field(default_factory=dict)  # start -> end, as P computed them
    skip: int = 0  # the first token staged: P did not send [0, skip)
    ended: bool = False
    claimed: bool = False
    writer_done: bool = False  # the pushing connection will not write again
    reader_done: bool = False  # no decode request will read it (loaded, given up, expired)
    failed: str | None = None  # cause

    @property
    def complete(self) -> bool:
        if not self.ended or self.failed is not None:
            return False
        if any(n != self.num_tokens - self.skip for n in self.tokens_per_layer):
            return False
        t = self.skip
        for s in sorted(self.chunks):  # chunks must tile [skip, num_tokens) exactly
            if s != t:
                return False
            t = self.chunks[s]
        return t == self.num_tokens


class StagingArea:
    """Thread-safe registry of staged transfers over one SharedSegment."""

    def __init__(self, capacity: int, shape: KVShape, lease_s: float, stats: ConnectorStats,
                 done: DoneTable | None = None, heads: RankHeads | None = None) -> None:
        """`shape`: this rank's heads; `heads`: where they sit among the model's (default: a
        single rank holding them all)."""
        self.segment = SharedSegment(capacity)
        self.done = done
        self.shape = shape
        self.heads = heads or RankHeads.single(shape.num_kv_heads, shape.latent)
        self.lease_s = lease_s
        self.stats = stats
        self._alloc = RegionAllocator(self.segment.size)
        self._lock = threading.Lock()
        self._transfers: dict[str, StagedTransfer] = {}
        # transfer_id -> final status, for fast load errors
        self._done: dict[str, TransferStatus] = {}

    # -- receiving side (listener threads) --------------------------------------------------
    def piece_shape(self, staged_id: str) -> KVShape:
        """The staging shape of a transfer (this rank's heads) or of a piece `<id>@lo-hi` of
        it (`connector.ranks`); StagingRefused("heads_not_held") if this rank lacks them."""
        _, at, heads = staged_id.partition("@")
        if not at:
            return self.shape
        try:
            lo, hi = (int(h) for h in heads.split("-"))
            self.heads.local((lo, hi))
        except ValueError:
            raise StagingRefused("heads_not_held") from None
        return replace(self.shape, num_kv_heads=hi - lo)

    def begin(self, transfer_id: str, num_tokens: int, skip: int = 0) -> StagedTransfer:
        """Reserve the region of the prompt tokens [skip, num_tokens) of a transfer, or of a
        piece of one (`piece_shape`)."""
        shape = self.piece_shape(transfer_id)
        nbytes = shape.transfer_bytes(num_tokens - skip)
        with self._lock:
            if (transfer_id in self._transfers or transfer_id in self._done
                    or self._done.get(transfer_of(transfer_id)) == TransferStatus.DISCARDED):
                raise StagingRefused("duplicate_transfer_id")
            if skip < 0:
                raise StagingRefused("bad_skip")
            if num_tokens - skip <= 0:
                raise StagingRefused("empty_transfer")
            offset = self._alloc.alloc(nbytes)
            if offset is None:
                self._remember(transfer_id, TransferStatus.REFUSED)
                raise StagingRefused("staging_full")
            rec = self.stats.open(transfer_id, "recv", num_tokens - skip, nbytes, skip)
            st = StagedTransfer(transfer_id, num_tokens, offset, nbytes, rec,
                                time.monotonic() + self.lease_s, shape,
                                tokens_per_layer=[0] * self.shape.num_layers, skip=skip)
            self._transfers[transfer_id] = st
            return st

    def region(self, st: StagedTransfer, start: int, nbytes: int) -> memoryview:
        base = st.offset + start
        if start < 0 or start + nbytes > st.nbytes:
            raise ValueError("write outside the transfer's region")
        return memoryview(self.segment.tensor[base:base + nbytes].numpy())

    def layer_received(self, st: StagedTransfer, layer: int, tokens: int,
                       written_s: float | None = None) -> None:
        """`written_s`: when P wrote the payload into shared memory (its frame comes later)."""
        with self._lock:
            now = time.time()
            first = min(now, written_s) if written_s is not None else now
            if st.record.first_byte_s is None or first < st.record.first_byte_s:
                st.record.first_byte_s = first
            st.tokens_per_layer[layer] += tokens

    def end(self, st: StagedTransfer) -> bool:
        """Mark the END marker seen; True if the transfer is complete and verified."""
        with self._lock:
            st.ended = True
            ok = st.complete
            if ok:  # the lease of KV complete and not yet claimed runs from now
                st.lease_deadline = time.monotonic() + self.lease_s
            if ok and self.done is not None and not st.reader_done:
                self.done.mark(st.transfer_id)
        if ok:
            self.stats.close(st.record, TransferStatus.COMPLETE)
        else:
            self.fail(st, st.failed or "short_transfer")
        return ok

    def fail(self, st: StagedTransfer, cause: str,
             status: TransferStatus = TransferStatus.FAILED) -> None:
        """The transfer went wrong (`status` `failed`, or `aborted`: P gave it up); its record
        ends with `status` and `cause`. An unclaimed one needs no reader any more."""
        with self._lock:
            if st.failed is None:
                st.failed = cause
            if not st.claimed:
                st.reader_done = True
                self._remember(st.transfer_id, status)
            self._free_if_done_locked(st, status)
        self.stats.close(st.record, status, cause)

    def writer_done(self, st: StagedTransfer) -> None:
        """The pushing connection will never write this region again."""
        with self._lock:
            st.writer_done = True
            self._free_if_done_locked(
                st, TransferStatus.FAILED if st.failed else TransferStatus.COMPLETE)

    # -- loading side (the worker's main thread) --------------------------------------------
    def claim(self, transfer_id: str) -> StagedTransfer | None:
        """Pin a transfer for a decode request (the reaper no longer frees it)."""
        with self._lock:
            st = self._transfers.get(transfer_id)
            if st is None or st.reader_done:
                return None
            st.claimed = True
            return st

    def discard(self, transfer_id: str) -> bool:
        """No decode request will come for this transfer (the request ended at t1, or its client
        left): free it and its pieces now, or refuse them at BEGIN if their push has not
        started. True if any was found."""
        with self._lock:
            found = [st for sid, st in self._transfers.items()
                     if transfer_id in (sid, transfer_of(sid))]
            if transfer_id not in self._transfers and transfer_id not in self._done:
                self._remember(transfer_id, TransferStatus.DISCARDED)
            let_go = [st for st in found if not (st.claimed or st.reader_done)]
            for st in let_go:  # the others: a decode request owns them, or they are let go
                st.reader_done = True
                self._remember(st.transfer_id, TransferStatus.DISCARDED)
                self._free_if_done_locked(st, TransferStatus.DISCARDED)
        for st in let_go:
            self.stats.close(st.record, TransferStatus.DISCARDED)
        return bool(found)

    def final_status(self, transfer_id: str) -> TransferStatus | None:
        """The transfer's terminal status (`failed`, `refused`, `aborted`, `expired`, `loaded`,
        ...) once it can no longer be loaded; None before."""
        with self._lock:
            return self._done.get(transfer_id)

    def release(self, st: StagedTransfer, status: TransferStatus) -> None:
        """The loader is done with a claimed transfer (loaded, or gave up on it)."""
        with self._lock:
            st.reader_done = True
            self._remember(st.transfer_id, status)
            self._free_if_done_locked(st, status)

    def reap(self, now: float | None = None) -> list[str]:
        """End the lease of every unclaimed transfer written whole and past its deadline;
        return their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [st for st in self._transfers.values()
                       if st.writer_done and not st.claimed and not st.reader_done
                       and st.lease_deadline <= now]
            for st in expired:
                st.reader_done = True
                st.failed = st.failed or "lease_expired"
                self._remember(st.transfer_id, TransferStatus.EXPIRED)
                self._free_if_done_locked(st, TransferStatus.EXPIRED)
        for st in expired:
            self.stats.close(st.record, TransferStatus.EXPIRED, "lease_expired")
        return [st.transfer_id for st in expired]

    def _free_if_done_locked(self, st: StagedTransfer, status: TransferStatus) -> None:
        if st.writer_done and st.reader_done and st.transfer_id in self._transfers:
            del self._transfers[st.transfer_id]
            self._alloc.free(st.offset, st.nbytes)
            self._remember(st.transfer_id, self._done.get(st.transfer_id, status))

    def _remember(self, transfer_id: str, status: TransferStatus) -> None:
        if self.done is not None:
            self.done.clear(transfer_id)
        self._done[transfer_id] = status
        while len(self._done) > 4 * 4096:
            self._done.pop(next(iter(self._done)))

    def state(self) -> dict[str, int]:
        with self._lock:
            return {
                "staged_bytes": sum(st.nbytes for st in self._transfers.values()),
                "staging_capacity_bytes": self._alloc.capacity,
                "staging_free_bytes": self._alloc.free_bytes,
                "open_leases": sum(1 for st in self._transfers.values() if not st.claimed),
                "claimed_transfers": sum(1 for st in self._transfers.values() if st.claimed),
            }

    def check_integrity(self) -> None:
        """Invariant when idle: free + staged bytes (aligned) == capacity."""
        with self._lock:
            staged = sum(-(-st.nbytes // ALIGN) * ALIGN for st in self._transfers.values())
            assert staged + self._alloc.free_bytes == self._alloc.capacity, "staging leak"

    def close(self) -> None:
        self.segment.close()
        if self.done is not None:
            self.done.close()
