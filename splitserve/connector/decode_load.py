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
from dataclasses import dataclass, field

from vllm.logger import init_logger

from splitserve.common.vocab import TransferStatus
from splitserve.config import ConnectorConfig
from splitserve.connector.devcopy import Completion, Copier, InlineCopies
from splitserve.connector.donetable import DoneTable, table_path
from splitserve.connector.layout.head_slice import HeadSlice
from splitserve.connector.layout.paged import PagedLayout
from splitserve.connector.layout.staging_format import KVShape, region_offset
from splitserve.connector.meta import LoadSpec, SplitserveMeta
from splitserve.connector.ranks import HeadRange, RankHeads
from splitserve.connector.segment import sweep_orphans
from splitserve.connector.staging import StagedTransfer, StagingArea
from splitserve.connector.stats import ConnectorStats, TransferRecord

logger = init_logger(__name__)


def open_staging(cfg: ConnectorConfig, engine_id: str, shape: KVShape, stats: ConnectorStats,
                 heads: RankHeads | None = None) -> StagingArea:
    """D's staging area (of tensor-parallel rank `heads`, default a single rank), after
    sweeping what decode workers killed with SIGKILL left in /dev/shm."""
    sweep_orphans()
    rank = heads.rank if heads is not None else 0
    return StagingArea(cfg.staging_bytes, shape, cfg.lease_s, stats,
                       DoneTable(table_path(engine_id, rank), True), heads)


def note_loaded(record: TransferRecord, spec: LoadSpec, seconds: float) -> None:
    """A successful load's figures in D's record of the transfer."""
    record.load_s = seconds
    record.loaded_tokens = spec.end - spec.start
    record.load_mode = "sync" if spec.sync else "async"
    record.scheduled_s = spec.scheduled_s

@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    # a transfer split by heads (from a P of more ranks): (staged id, this rank's local
    # heads) of every piece; empty: one staged transfer under the spec's id
    pieces: tuple[tuple[str, HeadRange], ...] = ()
    claimed: dict[str, StagedTransfer] = field(default_factory=dict)
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
            load = _Load(spec, now + self._cfg.load_timeout_s, self._pieces(spec))
            if spec.sync:
                self._load_now(load)
            else:
                self._loads[spec.request_id] = load

    def _pieces(self, spec: LoadSpec) -> tuple[tuple[str, HeadRange], ...]:
        """The pieces of a transfer from a P of `spec.prefill_tp` ranks, when there are
        several (`connector.ranks`); () when this rank gets it whole."""
        if self._staging is None or spec.prefill_tp <= 1:
            return ()
        rank = self._staging.heads
        pieces = rank.staged_pieces(spec.transfer_id, spec.prefill_tp)
        return tuple((sid, rank.local(h)) for sid, h in pieces) if len(pieces) > 1 else ()

    def _load_now(self, load: _Load) -> None:
        """A synchronous load (the transfer was complete when scheduled): copy before the forward,
        or report the blocks as failed so vLLM recomputes them (or fails the request)."""
        try:
            result = (self._poll_load(load, float("inf")) if self._staging
                      else "not_a_decode_worker")
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
        note_loaded(st.record, load.spec, time.perf_counter() - load.copy_t0)
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
        if load.pieces:
            return self._poll_pieces(load, now)
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

    def _poll_pieces(self, load: _Load, now: float) -> str | None:
        """`_poll_load` of a transfer split by heads: every piece claimed, complete and verified,
        then copied into its heads of the blocks (synchronously, one piece after another);
        any piece failed or late fails them all."""
        assert self._staging is not None
        spec, staging = load.spec, self._staging
        for sid, _ in load.pieces:
            if sid not in load.claimed and (st := staging.claim(sid)) is not None:
                load.claimed[sid] = st
        cause: str | None = None
        for sid, _ in load.pieces:
            st = load.claimed.get(sid)
            final = staging.final_status(sid) if st is None else None
            if final is not None:
                cause = f"transfer_{final.value}"
            elif st is not None and st.skip > spec.start:
                cause = "prefix_not_cached"
            elif st is not None and st.failed:
                cause = st.failed
            elif st is not None and st.complete and st.num_tokens != spec.end:
                cause = "length_mismatch"
            if cause:
                break
        ready = len(load.claimed) == len(load.pieces) and all(
            st.complete for st in load.claimed.values())
        if cause is None and not ready:
            if now <= load.deadline:
                return None
            cause = "load_timeout"
        t0 = time.perf_counter()
        if cause is None:
            try:
                for sid, (lo, hi) in load.pieces:
                    st = load.claimed[sid]
                    self._scatter_piece(st, spec, [HeadSlice(la, lo, hi) for la in self._layouts])
            except Exception:
                logger.exception("KV copy into the blocks of %s failed", spec.request_id)
                cause = "internal_error"
        for sid, _ in load.pieces:
            st = load.claimed.get(sid)
            if st is None:
                staging.discard(sid)  # never claimed: freed now, or refused when it begins
                continue
            status = TransferStatus.FAILED if cause else TransferStatus.LOADED
            if not cause:
                note_loaded(st.record, spec, time.perf_counter() - t0)
            staging.release(st, status)
            self._stats.close(st.record, status, cause)
        return cause or "ok"

    def _scatter_piece(self, st: StagedTransfer, spec: LoadSpec,
                       layouts: list[HeadSlice]) -> None:
        assert self._staging is not None
        seg = self._staging.segment.tensor
        for start in sorted(st.chunks):
            end = st.chunks[start]
            lo = max(start, spec.start)
            if lo >= end:
                continue
            nbytes = (end - start) * st.shape.bytes_per_token_layer
            for layer, layout in enumerate(layouts):
                base = st.offset + region_offset(st.shape, start, end, layer, st.skip)
                layout.scatter(spec.block_ids, lo, end, seg[base:base + nbytes], start)

    def _release_unloaded(self, staged_id: str) -> bool:
        """Free a staged transfer no request will load; whether it is gone (or never will be
        staged)."""
        assert self._staging is not None
        st = self._staging.claim(staged_id)
        if st is not None:
            self._staging.release(st, TransferStatus.DISCARDED)
            self._stats.close(st.record, TransferStatus.DISCARDED)
            return True
        return self._staging.final_status(staged_id) is not None

    def poll(self) -> LoadResults:
        """Loads that completed or failed since the last call (never waits)."""
        out = LoadResults(set(), set())
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            if self._staging is None:
                result: str | None = "not_a_decode_worker"
            elif load.spec.start == load.spec.end:  # nothing to load: release, report nothing
                ids = [sid for sid, _ in load.pieces] or [load.spec.transfer_id]
                released = [self._release_unloaded(sid) for sid in ids]
                if all(released) or now > load.deadline:
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
