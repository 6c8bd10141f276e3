"""Which staged transfers are complete, readable from the scheduler process.

The listener (worker process) marks a transfer when it is complete and verified and clears it
when its region is released; the scheduler (EngineCore process) looks a decode request's transfer
up in `get_num_new_matched_tokens`. A complete transfer is then loaded synchronously, in the same
engine step that computes t1 — one step less of handover than the asynchronous path.

A direct-mapped table of 64-bit hashes in an owner-only shared-memory file. It may forget (two
ids in one slot: the older one reads as not complete, so it takes the asynchronous path); it never
claims a transfer is complete that is not — and if a region is released between the lookup and
the load, the load reports its blocks as failed and vLLM recomputes them.
"""

from __future__ import annotations

import numpy as np
import xxhash

from splitserve.connector.segment import SharedSegment

SLOTS = 1 << 16


def table_path(engine_id: str, rank: int = 0) -> str:
    """The DoneTable of one tensor-parallel rank of an engine."""
    safe = "".join(c for c in engine_id if c.isalnum() or c == "-")
    return f"/dev/shm/splitserve-done-{safe}" + (f"-rank{rank}" if rank else "")


class DoneTable:
    def __init__(self, path: str, create: bool) -> None:
        self.path = path
        self._segment = SharedSegment(SLOTS * 8, path, create=create)
        self._slots = self._segment.tensor.numpy().view(np.uint64)

    @classmethod
    def open_existing(cls, path: str) -> DoneTable | None:
        try:
            return cls(path, create=False)
        except OSError:
            return None

    @staticmethod
    def _key(transfer_id: str) -> tuple[int, np.uint64]:
        h = xxhash.xxh3_64_intdigest(transfer_id.encode()) | 1  # never 0 (empty)
        return h % SLOTS, np.uint64(h)

    def mark(self, transfer_id: str) -> None:
        slot, h = self._key(transfer_id)
        self._slots[slot] = h

    def clear(self, transfer_id: str) -> None:
        slot, h = self._key(transfer_id)
        if self._slots[slot] == h:
            self._slots[slot] = 0

    def contains(self, transfer_id: str) -> bool:
        slot, h = self._key(transfer_id)
        return bool(self._slots[slot] == h)

    def close(self) -> None:
        del self._slots
        self._segment.close()
