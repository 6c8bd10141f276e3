"""D's loads (the worker process of a decode worker).

A decode request's load is registered in `start` and completed in `poll` once its transfer is
staged complete and verified: its KV is copied into the blocks vLLM allocated — never blocking
the running batch — or the load is reported failed (late, short, corrupt, refused, peer gone),
which vLLM's `kv_load_failure_policy` turns into a recompute or an error. A load is copied from
D's own prefix-cache hit (the spec's start) to the prompt's end; a transfer whose first token lies
beyond that hit (P skipped a prefix D no longer holds, or never held) cannot fill the gap and
fails at once as `prefix_not_cached`. A synchronous load
(the transfer was complete when the request was scheduled) is copied before the forward pass,
or its blocks are reported as load errors. The copies into the blocks go through the
worker's `Copier` (`devcopy`): on a CUDA engine they run on a side stream while the engine
steps, and a load is reported (its staged bytes freed) only once they completed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.logger import init_logger

from splitserve.common.vocab import TransferStatus
from splitserve.config import ConnectorConfig
from splitserve.connector.devcopy import Completion, Copier, InlineCopies
from splitserve.connector.donetable import DoneTable, table_path
from splitserve.connector.layout.paged import PagedLayout
from splitserve.connector.layout.staging_format import KVShape, region_offset
from splitserve.connector.meta import LoadSpec, SplitserveMeta
from splitserve.connector.segment import sweep_orphans
from splitserve.connector.staging import StagedTransfer, StagingArea
from splitserve.connector.stats import ConnectorStats

logger = init_logger(__name__)


def open_staging(cfg: ConnectorConfig, engine_id: str, shape: KVShape, stats: ConnectorStats
                 ) -> StagingArea:
    """D's staging area, after sweeping what decode workers killed with SIGKILL left in
    /dev/shm."""
    sweep_orphans()
    return StagingArea(cfg.staging_bytes, shape, cfg.lease_s, stats,
                       DoneTable(table_path(engine_id), True))


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    staged: StagedTransfer | None = None
    copies: list[Completion] | None = None  # the copies into the blocks, once started
    copy_t0: float = 0.0


@dataclass
class LoadResults:
    finished: set[str]
    failed: set[str]  # a subset of `finished`


class DecodeLoads:
    """Pending loads into this worker's blocks. `staging` None: not a decode worker, so every
    load fails. Called on the engine's worker thread only."""

    def __init__(self, cfg: ConnectorConfig, staging: StagingArea | None, stats: ConnectorStats,
                 layouts: list[PagedLayout], shape: KVShape, copier: Copier | None = None
                 ) -> None:
        self._cfg = cfg
        self._copier = copier or InlineCopies()
        self._staging = staging
        self._stats = stats
        self._layouts, self._shape = layouts, shape
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()  # blocks of failed synchronous loads

    @property
    def pending(self) -> int:
        return len(self._loads)

    def start(self, meta: SplitserveMeta) -> None:
        now = time.monotonic()
        for spec in meta.loads:
            load = _Load(spec, now + self._cfg.load_timeout_s)
            if spec.sync:
                self._load_now(load)
            else:
                self._loads[spec.request_id] = load

    def _load_now(self, load: _Load) -> None:
        """A synchronous load (the transfer was complete when scheduled): copy before the forward,
        or report the blocks as failed so vLLM recomputes them (or fails the request)."""
        try:
            result = self._poll_load(load, float("inf")) if self._staging else "not_a_decode_worker"
            if result is None and load.copies is not None and load.staged is not None:
                result = self._copied(load, load.staged, wait=True)  # the forward reads them
        except Exception:
            logger.exception("KV load for %s failed", load.spec.request_id)
            result = "internal_error"
        if result != "ok":
            spec = load.spec
            bs = self._layouts[0].block_size
            self._load_errors |= set(spec.block_ids[spec.start // bs:-(-spec.end // bs)])

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _start_copies(self, st: StagedTransfer, spec: LoadSpec, copies: list[Completion]
                      ) -> None:
        """Queue (CPU: make) the copies of a complete, verified transfer into the blocks,
        appending to `copies` what to wait for before reporting the request ready and freeing
        the staged bytes (appended as queued, so a copy queued before a failure is waited for)."""
        assert self._staging is not None
        seg = self._staging.segment.tensor
        shape = self._shape
        for start in sorted(st.chunks):
            end = st.chunks[start]
            lo = max(start, spec.start)
            if lo >= end:
                continue  # D already had these tokens in its prefix cache
            nbytes = (end - start) * shape.bytes_per_token_layer
            for layer, layout in enumerate(self._layouts):
                base = st.offset + region_offset(shape, start, end, layer, st.skip)
                region = seg[base:base + nbytes]
                done = self._copier.load(layout, spec.block_ids, lo, end, region, start)
                if done is None:  # the copier's buffers are all in flight: drain ours, retry
                    for queued in copies:
                        queued.wait()
                    done = self._copier.load(layout, spec.block_ids, lo, end, region, start)
                if done is None:
                    layout.scatter(spec.block_ids, lo, end, region, start)
                else:
                    copies.append(done)

    def _copied(self, load: _Load, st: StagedTransfer, wait: bool = False) -> str | None:
        """Once every copy into the blocks completed (`wait`: block until then): release the
        staged bytes and report "ok"; None while they run; a cause if one failed."""
        assert self._staging is not None and load.copies is not None
        try:
            if wait:
                for done in load.copies:
                    done.wait()
            elif not all(done.done() for done in load.copies):
                return None  # still copying into the blocks (CUDA: on the side stream)
        except Exception:
            logger.exception("KV copy into the blocks of %s failed", load.spec.request_id)
            return self._give_up(load, st, "internal_error")
        spec = load.spec
        st.record.load_s = time.perf_counter() - load.copy_t0
        st.record.loaded_tokens = spec.end - spec.start
        st.record.load_mode = "sync" if spec.sync else "async"
        self._staging.release(st, TransferStatus.LOADED)
        self._stats.close(st.record, TransferStatus.LOADED)
        return "ok"

    def _give_up(self, load: _Load, st: StagedTransfer, cause: str) -> str:
        """Fail the load: its staged bytes are freed only after every copy queued from them
        has finished (or failed), so no copy reads a region handed to another transfer."""
        assert self._staging is not None
        for done in load.copies or ():
            try:
                done.wait()
            except Exception:
                logger.exception("KV copy into the blocks of %s failed", load.spec.request_id)
        self._staging.release(st, TransferStatus.FAILED)
        self._stats.close(st.record, TransferStatus.FAILED, cause)
        return cause

    def _poll_load(self, load: _Load, now: float) -> str | None:
        """None while waiting; "ok"; or a failure cause."""
        assert self._staging is not None
        spec = load.spec
        if load.staged is None:
            load.staged = self._staging.claim(spec.transfer_id)
        st = load.staged
        if st is None:
            final = self._staging.final_status(spec.transfer_id)
            if final is not None:
                return f"transfer_{final.value}"
            return "load_timeout" if now > load.deadline else None
        if load.copies is not None:
            return self._copied(load, st)
        if st.skip > spec.start:
            # P skipped tokens D's cache does not hold: [spec.start, st.skip) is nowhere
            cause = "prefix_not_cached"
        elif st.failed:
            cause = st.failed
        elif st.complete:
            if st.num_tokens != spec.end:
                cause = "length_mismatch"
            else:
                load.copy_t0 = time.perf_counter()
                load.copies = []
                try:
                    self._start_copies(st, spec, load.copies)
                except Exception:
                    logger.exception("KV copy into the blocks of %s failed", spec.request_id)
                    return self._give_up(load, st, "internal_error")
                return self._copied(load, st)
        elif now > load.deadline:
            cause = "load_timeout"
        else:
            return None
        return self._give_up(load, st, cause)

    def poll(self) -> LoadResults:
        """Loads that completed or failed since the last call (never waits)."""
        out = LoadResults(set(), set())
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            if self._staging is None:
                result: str | None = "not_a_decode_worker"
            elif load.spec.start == load.spec.end:  # nothing to load: release, report nothing
                st = self._staging.claim(load.spec.transfer_id)
                if st is not None:
                    self._staging.release(st, TransferStatus.DISCARDED)
                    self._stats.close(st.record, TransferStatus.DISCARDED)
                if (st is not None or now > load.deadline
                        or self._staging.final_status(load.spec.transfer_id) is not None):
                    del self._loads[rid]
                continue
            else:
                try:
                    result = self._poll_load(load, now)
                except Exception:  # a connector fault fails this request, never the engine
                    logger.exception("KV load for %s failed", rid)
                    result = "internal_error"
            if result is None:
                continue
            del self._loads[rid]
            out.finished.add(rid)
            if result != "ok":
                out.failed.add(rid)
        return out
