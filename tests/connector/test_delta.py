"""Moving only the KV that D lacks (issue 24, item 5), without a server: P's scheduler side
starts the push at `skip_tokens`, P's sends and both transports carry only the prompt's suffix
[skip, n), D stages exactly those bytes, and D's real load path copies from its own prefix hit
onwards, or fails the load (`prefix_not_cached`) when its hit is short of the skipped prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from splitserve.common.wire import SideRecord
from splitserve.config import ConnectorConfig
from splitserve.connector.devcopy import InlineCopies
from splitserve.connector.donetable import DoneTable, table_path
from splitserve.connector.faults import Faults
from splitserve.connector.layout.cpu import VllmCpuLayout, paged_kv
from splitserve.connector.layout.paged import EngineKV
from splitserve.connector.layout.staging_format import region_offset
from splitserve.connector.listener import KVListener
from splitserve.connector.meta import LoadSpec, SaveSpec, SplitserveMeta
from splitserve.connector.scheduler_side import SchedulerSide, skip_tokens
from splitserve.connector.staging import StagingArea, StagingRefused
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.items import LayerItem
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel
from splitserve.connector.worker_side import WorkerSide
from splitserve.router.timings import Timings
from tests.support.channels import FP, SHAPE, assert_staged_equals, push, settle
from tests.support.scheduler import NewReq, Request, Step, cached, prefill_request

TOKEN = "delta-test-token-0123456789abcdef"
H, D, BS = SHAPE.num_kv_heads, SHAPE.head_dim, 16
CHANNELS = {"tcp": TcpPushChannel, "shm": ShmPushChannel}


# -- the staging format ----------------------------------------------------------------------
def test_regions_of_a_skipped_prefix_tile_only_the_suffix() -> None:
    """Chunks [skip, n) of every layer tile exactly transfer_bytes(n - skip) from offset 0."""
    skip, chunks = 40, [(40, 64), (64, 100), (100, 123)]
    spans = sorted((region_offset(SHAPE, s, e, layer, skip), (e - s) * SHAPE.bytes_per_token_layer)
                   for s, e in chunks for layer in range(SHAPE.num_layers))
    at = 0
    for off, size in spans:
        assert off == at
        at += size
    assert at == SHAPE.transfer_bytes(123 - skip)
    with pytest.raises(ValueError, match="before"):
        region_offset(SHAPE, 30, 64, 0, skip)


# -- P's scheduler side ----------------------------------------------------------------------
def prefill(rid: str, n: int, skip: object) -> Request:
    return prefill_request(rid, n, skip_tokens=skip)


@pytest.fixture
def side() -> Iterator[SchedulerSide]:
    path = table_path(f"delta-test-{uuid.uuid4().hex[:8]}")
    table = DoneTable(path, create=True)
    yield SchedulerSide("tcp", [path])
    table.close()


def spans(meta: SplitserveMeta) -> list[tuple[int, int, int, bool, bool]]:
    return [(s.start, s.end, s.skip, s.first, s.last) for s in meta.saves]


def test_skip_tokens_is_clamped_below_the_prompt_and_ignored_when_malformed() -> None:
    params: list[tuple[object, int]] = [(256, 256), (600, 599), (0, 0), (-5, 0), ("256", 0),
                                        (True, 0), (12.0, 0), (None, 0)]
    for raw, expected in params:
        assert skip_tokens({"skip_tokens": raw}, 600) == expected, raw
    assert skip_tokens({}, 600) == 0


def test_a_chunk_inside_the_skipped_prefix_pushes_nothing_and_begin_waits_for_the_next(
        side: SchedulerSide) -> None:
    """skip 256 = P's first 256-token chunk: nothing moves at step 1, BEGIN opens with the
    second chunk, whose blocks the table by then includes."""
    req = prefill("a", 600, 256)
    side.on_new_request(req)
    meta = side.build_connector_meta(Step({"a": 256}, [NewReq("a", ([4, 9],))]))
    assert meta.saves == []
    meta = side.build_connector_meta(Step({"a": 256}, scheduled_cached_reqs=cached("a", 256,
                                                                                   [2, 6])))
    assert meta.saves == [SaveSpec("a", "t-a", "10.0.0.2", 7001, "tcp", (4, 9, 2, 6), 256, 512,
                                   600, 256)]
    assert spans(meta) == [(256, 512, 256, True, False)]
    meta = side.build_connector_meta(Step({"a": 88}, scheduled_cached_reqs=cached("a", 512,
                                                                                  [1])))
    assert spans(meta) == [(512, 600, 256, False, True)]
    assert side.request_finished(req, []) == (
        True, {"transfer_id": "t-a", "pushed_tokens": 344, "skipped_tokens": 256})


def test_a_skip_inside_a_chunk_pushes_the_rest_of_it_even_what_p_had_cached(
        side: SchedulerSide) -> None:
    """skip 128 within P's first chunk; and a prompt P had cached up to 192 (it computes from
    192) with skip 64: P sends [64, n), the tokens it did not compute included."""
    side.on_new_request(prefill("b", 300, 128))
    side.on_new_request(prefill("c", 300, 64))
    meta = side.build_connector_meta(Step({"b": 256, "c": 108},
                                          [NewReq("b", ([1, 2],)),
                                           NewReq("c", ([3, 5, 7],), num_computed_tokens=192)]))
    assert [(s.request_id, s.start, s.end, s.first, s.last) for s in meta.saves] == [
        ("b", 128, 256, True, False), ("c", 64, 300, True, True)]


def test_a_push_preempted_before_it_began_resumes_with_its_new_block_table(
        side: SchedulerSide) -> None:
    """Preempted while every computed chunk lay in the skipped prefix (no push began, nothing
    to cancel): vLLM resumes it with a new block table, which the push must read."""
    side.on_new_request(prefill("r", 600, 256))
    side.build_connector_meta(Step({"r": 256}, [NewReq("r", ([4, 9],))]))
    meta = side.build_connector_meta(Step(preempted_req_ids={"r"}))
    assert meta.cancels == []
    meta = side.build_connector_meta(Step({"r": 512}, scheduled_cached_reqs=cached(
        "r", 0, [11, 12, 13, 14], resumed=True)))
    assert [(s.block_ids, s.start, s.end, s.first) for s in meta.saves] == [
        ((11, 12, 13, 14), 256, 512, True)]


# -- P's sends and the channel ---------------------------------------------------------------
@pytest.fixture
def listener() -> Iterator[tuple[KVListener, StagingArea]]:
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {})
    yield lis, staging
    lis.close()
    staging.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
@pytest.mark.parametrize("chunks", [[(64, 100), (100, 230)],  # skip at a block end
                                    [(100, 230)],  # skip = P's chunk boundary
                                    [(37, 100), (100, 230)],  # skip mid-block, mid-chunk
                                    [(229, 230)]])  # all but the last token
def test_only_the_suffix_moves_and_lands_where_the_loader_reads_it(
        listener: tuple[KVListener, StagingArea], kind: str, chunks: list[tuple[int, int]]
        ) -> None:
    lis, staging = listener
    torch.manual_seed(3)
    caches = [torch.randn(6, 2, 64, 64) for _ in range(2)]  # block size 64
    blocks = (4, 1, 2, 5)
    skip = chunks[0][0]
    ch = CHANNELS[kind]("127.0.0.1", lis.port, TOKEN, FP, ConnectorStats(), Faults(False),
                        SHAPE, 2.0)
    tid = f"delta-{kind}-{skip}"
    push(ch, tid, caches, blocks, chunks)
    assert settle(ch, tid) == "complete"
    sent = ch.poll(tid)
    assert sent is not None
    moved = SHAPE.transfer_bytes(230 - skip)
    assert (sent.record.tokens, sent.record.bytes, sent.record.skipped_tokens) == (
        230 - skip, moved, skip)
    st = staging.claim(tid)
    assert st is not None and st.complete and (st.skip, st.num_tokens, st.nbytes) == (
        skip, 230, moved)
    recv = st.record.to_wire()
    assert (recv.tokens, recv.bytes, recv.skipped_tokens) == (230 - skip, moved, skip)
    assert_staged_equals(staging, st, caches, blocks, chunks)
    staging.release(st, "loaded")
    assert staging.state()["staged_bytes"] == 0
    ch.close()


def test_a_layer_before_the_transfers_first_token_ends_the_connection(
        listener: tuple[KVListener, StagingArea]) -> None:
    """D never writes outside the suffix it reserved: a chunk that starts before `skip` is a
    protocol error, and the transfer fails."""
    lis, staging = listener
    caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
    ch = TcpPushChannel("127.0.0.1", lis.port, TOKEN, FP, ConnectorStats(), Faults(False), SHAPE,
                        2.0)
    ch.begin("early-chunk", 100, SHAPE.transfer_bytes(60), ack_timeout_s=5.0, skip=40)
    for layer, cache in enumerate(caches):
        ch.push_layer(LayerItem("early-chunk", layer, 0, 100, VllmCpuLayout(cache), (0, 1)))
    ch.end("early-chunk")
    assert settle(ch, "early-chunk") == "failed"
    ch.close()


def test_staging_refuses_an_empty_or_negative_suffix(
        listener: tuple[KVListener, StagingArea]) -> None:
    _, staging = listener
    with pytest.raises(StagingRefused, match="empty_transfer"):
        staging.begin("all-skipped", 100, skip=100)
    with pytest.raises(StagingRefused, match="bad_skip"):
        staging.begin("negative", 100, skip=-1)
    st = staging.begin("suffix", 100, skip=99)
    assert st.nbytes == SHAPE.transfer_bytes(1)
    for layer in range(SHAPE.num_layers):  # a suffix that does not start at `skip` is short
        st.chunks[98] = 100
        staging.layer_received(st, layer, 1)
    assert not st.complete
    staging.fail(st, "test")
    staging.writer_done(st)


# -- D's load of a skipped transfer ----------------------------------------------------------
P_BLOCKS, D_BLOCKS = (5, 0, 7, 2), (9, 3, 1, 6)
N, SKIP = 50, 16  # the prompt; P skipped D's first block


def _decode_worker(monkeypatch: pytest.MonkeyPatch, tids: tuple[str, ...]
                   ) -> tuple[WorkerSide, dict[str, torch.Tensor], list[torch.Tensor]]:
    """D's real WorkerSide on vLLM-CPU's layout, with the transfers `tids` of the prompt's
    tokens [16, 50) (chunks [16, 30), [30, 50)) pushed to it complete and verified."""
    monkeypatch.setenv("SPLITSERVE_TOKEN", TOKEN)
    d = WorkerSide(ConnectorConfig(role="decode", staging_bytes=4 * 1024**2), "delta-d",
                   {"model": "x"}, torch.float32, "0.32.0", copier=InlineCopies())
    d_caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(10, H, BS, 2 * D)
                for i in range(SHAPE.num_layers)}
    d.register_kv_caches(d_caches, EngineKV("cpu", ("CPU_ATTN",), "LBHNC",
                                            spec_kinds=("FullAttentionSpec",)))
    assert d.listener is not None and d.fingerprint is not None
    torch.manual_seed(7)
    p_caches = [torch.randn(8, H, BS, 2 * D) for _ in range(SHAPE.num_layers)]
    p = TcpPushChannel("127.0.0.1", d.listener.port, TOKEN, d.fingerprint, ConnectorStats(),
                       Faults(False), SHAPE, 2.0, copier=InlineCopies())
    for tid in tids:
        p.begin(tid, N, SHAPE.transfer_bytes(N - SKIP), ack_timeout_s=5.0, skip=SKIP)
        for s, e in [(SKIP, 30), (30, N)]:
            for layer, cache in enumerate(p_caches):
                p.push_layer(LayerItem(tid, layer, s, e, VllmCpuLayout(cache), P_BLOCKS))
        p.end(tid)
        assert settle(p, tid) == "complete"
    p.close()
    return d, d_caches, p_caches


def _loaded_exactly(d_caches: dict[str, torch.Tensor], p_caches: list[torch.Tensor],
                    start: int) -> None:
    """D's blocks hold P's KV for tokens [start, N) and nothing before `start` was written."""
    names = sorted(d_caches)
    for layer in range(SHAPE.num_layers):
        kp, vp = paged_kv(p_caches[layer])
        kd, vd = paged_kv(d_caches[names[layer]])
        for t in range(N):
            pb, db = P_BLOCKS[t // BS], D_BLOCKS[t // BS]
            if t >= start:
                assert torch.equal(kd[db, :, :, t % BS], kp[pb, :, :, t % BS]), t
                assert torch.equal(vd[db, :, t % BS], vp[pb, :, t % BS]), t
            else:  # D's own prefix cache's tokens: the load leaves them alone
                assert not kd[db, :, :, t % BS].any() and not vd[db, :, t % BS].any(), t


@pytest.mark.parametrize("hit", [SKIP, 32])  # D's hit: exactly the skip, or a block beyond it
def test_d_loads_the_suffix_from_where_its_own_cache_ends(monkeypatch: pytest.MonkeyPatch,
                                                          hit: int) -> None:
    """A hit of 32 starts inside the staged chunk [30, 50): the copy skips its first 2 rows."""
    d, d_caches, p_caches = _decode_worker(monkeypatch, ("from-hit",))
    assert d.staging is not None
    d.start_load_kv(SplitserveMeta(loads=[LoadSpec("r", "from-hit", D_BLOCKS, hit, N)]))
    out = d.get_transfer_results(set())
    assert out.finished_recving == {"r"} and not out.failed_recving
    _loaded_exactly(d_caches, p_caches, hit)
    rec = d.stats.record("from-hit")
    assert rec is not None and rec.recv is not None
    assert (rec.recv.status, rec.recv.tokens, rec.recv.skipped_tokens, rec.recv.loaded_tokens,
            rec.recv.bytes) == ("loaded", N - SKIP, SKIP, N - hit,
                                SHAPE.transfer_bytes(N - SKIP))
    assert d.staging.state()["staged_bytes"] == 0
    d.shutdown()


def test_a_hit_short_of_the_skipped_prefix_fails_the_load(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """D holds nothing (async load) or only what the sync load's spec says (0 < 16): the gap
    [hit, 16) is nowhere, so the load fails at once, nothing is copied, the staged bytes are
    freed, and the sync load's blocks are reported for vLLM to recompute."""
    d, d_caches, _ = _decode_worker(monkeypatch, ("evicted-async", "evicted-sync"))
    assert d.staging is not None
    d.start_load_kv(SplitserveMeta(loads=[LoadSpec("a", "evicted-async", D_BLOCKS, 0, N)]))
    out = d.get_transfer_results(set())
    assert out.finished_recving == out.failed_recving == {"a"}
    d.start_load_kv(SplitserveMeta(loads=[LoadSpec("s", "evicted-sync", D_BLOCKS, 0, N,
                                                   sync=True)]))
    assert d.take_load_errors() == set(D_BLOCKS)
    for tid in ("evicted-async", "evicted-sync"):
        rec = d.stats.record(tid)
        assert rec is not None and rec.recv is not None
        assert (rec.recv.status, rec.recv.cause, rec.recv.loaded_tokens) == (
            "failed", "prefix_not_cached", None)
    assert all(not c.any() for c in d_caches.values())
    assert d.staging.state()["staged_bytes"] == 0
    d.shutdown()


# -- the router's side -----------------------------------------------------------------------
def test_the_record_and_the_timings_carry_the_skipped_prefix_and_the_bytes_moved() -> None:
    raw = {"transfer_id": "t", "side": "recv", "status": "loaded", "tokens": 44,
           "bytes": 45056, "skipped_tokens": 256}
    rec = SideRecord.from_json(raw)
    assert (rec.skipped_tokens, rec.bytes) == (256, 45056)
    assert SideRecord.from_json({**raw, "skipped_tokens": None}).skipped_tokens == 0
    timings = Timings(kv=rec).as_dict()
    assert (timings["kv_bytes"], timings["kv_skipped_tokens"]) == (45056, 256)
