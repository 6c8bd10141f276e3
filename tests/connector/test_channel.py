"""P's push channel into D's listener, in one process: bytes land where the loader reads them,
over both transports; corruption, refusal and a vanished peer settle the transfer as failed."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from splitserve.common.wire import SideRecord
from splitserve.config import ConnectorConfig
from splitserve.connector.control import ControlAnswers
from splitserve.connector.devcopy import Completion, InlineCopies
from splitserve.connector.faults import Faults
from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.listener import KVListener
from splitserve.connector.messages import Query
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats, TransferRecord
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.items import LayerItem
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import BufferPool, TcpPushChannel
from splitserve.router.legs.splitserve import SplitserveLegs
from tests.support.channels import FP, SHAPE, assert_staged_equals, push, settle, staged_region

TOKEN = "channel-test-token-0123456789"
CHANNELS = {"tcp": TcpPushChannel, "shm": ShmPushChannel}


@pytest.fixture
def listener() -> Iterator[tuple[KVListener, StagingArea]]:
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {"echo": q.to_wire()})
    yield lis, staging
    lis.close()
    staging.close()


NO_FAULTS = Faults(False)


def channel(kind: str, port: int, faults: Faults = NO_FAULTS) -> PushChannel:
    return CHANNELS[kind]("127.0.0.1", port, TOKEN, FP, ConnectorStats(), faults, SHAPE, 2.0)


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_chunked_push_arrives_intact(listener: tuple[KVListener, StagingArea], kind: str) -> None:
    lis, staging = listener
    torch.manual_seed(1)
    caches = [torch.randn(6, 2, 64, 64) for _ in range(2)]  # block size 64
    blocks = (4, 1, 2, 5)
    ch = channel(kind, lis.port)
    push(ch, f"ok-{kind}", caches, blocks, [(0, 100), (100, 230)])
    assert settle(ch, f"ok-{kind}") == "complete"
    st = staging.claim(f"ok-{kind}")
    assert st is not None and st.complete
    assert_staged_equals(staging, st, caches, blocks, ((0, 100), (100, 230)))
    staging.release(st, "loaded")
    assert staging.state()["staged_bytes"] == 0
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_corruption_is_detected(listener: tuple[KVListener, StagingArea], kind: str) -> None:
    lis, staging = listener
    caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
    ch = channel(kind, lis.port, Faults(enabled=True))
    push(ch, "x-fault-corrupt", caches, (0, 1), [(0, 120)])
    assert settle(ch, "x-fault-corrupt") == "failed"
    assert ch.poll("x-fault-corrupt").record.cause == "checksum_mismatch"
    assert staging.final_status("x-fault-corrupt") == "failed"
    assert staging.state()["staged_bytes"] == 0
    ch.close()


def test_tail_from_another_host_adds_two_one_clock_spans() -> None:
    """P on another host (its wall clock not in D's record): P's span from its last layer to END
    plus D's from reading END to verifying it; neither clock is set against the other."""
    rec = TransferRecord("t", "recv", complete_s=1000.25, end_received_s=1000.20,
                         end_lag_s=0.03)
    assert rec.to_wire().tail_s == pytest.approx(0.08)
    assert TransferRecord("t", "recv", complete_s=1000.25).to_wire().tail_s is None


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_records_time_the_exposed_tail_and_the_wire(listener: tuple[KVListener, StagingArea],
                                                    kind: str) -> None:
    """P stamps the end of its last layer and the seconds its bytes moved; D gets both with END
    (P on D's host: the same clock): `tail_s` runs from the last layer to D's verified END,
    `gbps` is bytes over the wire time, and `duration_s` stays BEGIN to END."""
    lis, staging = listener
    caches = [torch.randn(5, 2, 64, 64) for _ in range(2)]
    ch = channel(kind, lis.port)
    before = time.time()
    push(ch, f"tail-{kind}", caches, (3, 1, 4), [(0, 64), (64, 150)])
    assert settle(ch, f"tail-{kind}") == "complete"
    sent = ch.poll(f"tail-{kind}").record
    assert sent.last_layer_s is not None and before <= sent.last_layer_s <= time.time()
    assert sent.wire_s == pytest.approx(
        sent.copy_forward_s + sent.sender_layers_s + sent.sender_sends_s) and sent.wire_s > 0
    record = staging.stats.record(f"tail-{kind}")
    assert record is not None and record.recv is not None
    recv = record.recv
    assert sent.end_lag_s is not None and 0 <= sent.end_lag_s <= time.time() - sent.last_layer_s
    assert (recv.last_layer_s, recv.end_lag_s, recv.wire_s) == (
        sent.last_layer_s, sent.end_lag_s, sent.wire_s)  # P is on D's host: one clock
    assert recv.end_received_s is not None and recv.complete_s is not None
    assert recv.end_received_s <= recv.complete_s
    assert recv.tail_s == pytest.approx(recv.complete_s - sent.last_layer_s)
    assert recv.duration_s == pytest.approx(recv.complete_s - recv.started_s)
    assert recv.gbps == pytest.approx(recv.bytes / sent.wire_s / 1e9)
    staged = staging.claim(f"tail-{kind}")
    assert staged is not None
    staging.release(staged, "loaded")
    ch.close()


def test_wrong_token_never_stages(listener: tuple[KVListener, StagingArea]) -> None:
    lis, staging = listener
    ch = TcpPushChannel("127.0.0.1", lis.port, "not-the-token", FP, ConnectorStats(),
                        Faults(False), SHAPE, 2.0)
    push(ch, "intruder", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "intruder") == "failed"
    assert ch.poll("intruder").record.cause == "peer_refused"
    assert staging.state()["staged_bytes"] == 0 and staging.final_status("intruder") is None
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_channel_knows_when_its_d_is_gone(kind: str) -> None:
    """Connected once a transfer went through; not connected once D's listener closed its
    connections (P's send bookkeeping then drops the channel)."""
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {})
    ch = channel(kind, lis.port)
    assert not ch.connected
    push(ch, "once", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "once") == "complete" and ch.connected
    lis.close()
    deadline = time.monotonic() + 5
    while ch.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ch.connected
    ch.close()
    staging.close()


def hold_begin(staging: StagingArea) -> tuple[threading.Event, threading.Event]:
    """D holds its answer to every BEGIN until the test sets `gate`; `asked` is set once a
    BEGIN has reached D."""
    asked, gate, begin = threading.Event(), threading.Event(), staging.begin

    def held(*args: Any) -> Any:
        asked.set()
        gate.wait(5)
        return begin(*args)

    staging.begin = held  # type: ignore[method-assign]
    return asked, gate


class FailingCopies(InlineCopies):
    def save(self, *args: object) -> Completion:
        raise RuntimeError("device copy failed")


def test_a_transfer_failed_before_d_opened_it_frees_d_region_at_once(
        listener: tuple[KVListener, StagingArea]) -> None:
    """tcp copies on the forward thread before D answered BEGIN: when that copy fails, P has
    given up before D's BEGIN_OK (with D's region) arrives, and then ABORTs it, so D frees the
    region now, not when its 30 s lease runs out."""
    lis, staging = listener
    asked, gate = hold_begin(staging)
    ch = TcpPushChannel("127.0.0.1", lis.port, TOKEN, FP, ConnectorStats(), NO_FAULTS, SHAPE,
                        2.0, copier=FailingCopies())
    cache = torch.randn(2, 2, 64, 64)
    ch.begin("early", 10, SHAPE.transfer_bytes(10), ack_timeout_s=5.0)
    assert asked.wait(5)  # BEGIN reached D
    ch.push_layer(LayerItem("early", 0, 0, 10, VllmCpuLayout(cache), (0,)))
    assert settle(ch, "early") == "failed" and ch.poll("early").record.cause == "internal_error"
    assert staging.state()["staged_bytes"] == 0  # D has not opened it yet
    gate.set()
    deadline = time.monotonic() + 5
    while staging.final_status("early") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.final_status("early") == "aborted"  # P gave it up
    assert staging.state()["staged_bytes"] == 0
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_cancel_while_d_has_not_answered_begin_returns_at_once(
        listener: tuple[KVListener, StagingArea], kind: str) -> None:
    """P's engine thread cancels (an abort mid-prefill, a preemption) while its sender waits for
    D's BEGIN_OK: the cancel returns at once, not when D answers or BEGIN times out, and D's
    region is freed once D has opened it."""
    lis, staging = listener
    asked, gate = hold_begin(staging)
    ch = channel(kind, lis.port)
    ch.begin("slow", 10, SHAPE.transfer_bytes(10), ack_timeout_s=5.0)
    assert asked.wait(5)
    t0 = time.monotonic()
    ch.cancel("slow")
    assert time.monotonic() - t0 < 1.0
    gate.set()
    deadline = time.monotonic() + 5
    while staging.final_status("slow") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.final_status("slow") == "aborted" and staging.state()["staged_bytes"] == 0
    ch.close()


def test_vanished_peer_fails_pending_transfers() -> None:
    ch = channel("tcp", 9)  # nothing listens on the discard port
    push(ch, "lost", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "lost") == "failed"
    assert ch.poll("lost").record.cause == "peer_unreachable"
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_connect_refused_once_is_tried_again(kind: str, caplog: pytest.LogCaptureFixture
                                               ) -> None:
    """D's listener is not up when P first connects (refused), and is by the next try: the
    transfer arrives intact, its region then freed."""
    with socket.socket() as probe:  # a port nothing listens on, for now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    ch = channel(kind, port)
    caches = [torch.randn(2, 2, 64, 64) for _ in range(2)]
    lis = None
    try:
        with caplog.at_level(logging.WARNING, logger="splitserve.connector.transport.base"):
            push(ch, "late-d", caches, (1,), [(0, 50)])
            deadline = time.monotonic() + 5
            while "try 1 of" not in caplog.text:  # the first connect was refused
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.005)
            lis = KVListener("127.0.0.1", port, TOKEN, FP, staging, lambda q: {})
            assert settle(ch, "late-d") == "complete"
        assert "failed" not in caplog.text.split("try 1 of", 1)[1], caplog.text
        st = staging.claim("late-d")
        assert st is not None and st.complete
        assert_staged_equals(staging, st, caches, (1,), ((0, 50),))
        staging.release(st, "loaded")
        assert staging.state()["staged_bytes"] == 0
    finally:
        ch.close()
        if lis is not None:
            lis.close()
        staging.close()


def test_open_shm_transfer_is_copied_on_the_calling_thread(
        listener: tuple[KVListener, StagingArea]) -> None:
    """Once D answered BEGIN, push_layer has written the layer into D's staging before it
    returns (no sender thread involved); END then sends every held frame and D verifies."""
    lis, staging = listener
    torch.manual_seed(3)
    caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
    ch = channel("shm", lis.port)
    st = ch.begin("inline-shm", 120, SHAPE.transfer_bytes(120), ack_timeout_s=5.0)
    assert st.began.wait(5.0) and st.offset >= 0
    region = staged_region(staging, st.offset, 0, 120, 0)
    region.zero_()
    ch.push_layer(LayerItem("inline-shm", 0, 0, 120, VllmCpuLayout(caches[0]), (2, 0)))
    assert bool(region.any()) and len(st.unsent) == 1  # copied now; its frame held for END
    assert st.record.copy_forward_s > 0 and st.record.sender_layers_s == 0
    ch.push_layer(LayerItem("inline-shm", 1, 0, 120, VllmCpuLayout(caches[1]), (2, 0)))
    ch.end("inline-shm")
    assert settle(ch, "inline-shm") == "complete"
    staged = staging.claim("inline-shm")
    assert staged is not None and staged.record.first_byte_s is not None
    assert staged.record.first_byte_s <= staged.record.complete_s
    assert_staged_equals(staging, staged, caches, (2, 0), ((0, 120),))
    staging.release(staged, "loaded")
    ch.close()


@pytest.mark.parametrize("pool_bytes", [64 * 1024**2, 0], ids=["pooled", "pool-exhausted"])
def test_tcp_gathers_into_pooled_buffers_or_leaves_it_to_the_sender(
        listener: tuple[KVListener, StagingArea], pool_bytes: int) -> None:
    lis, staging = listener
    torch.manual_seed(4)
    caches = [torch.randn(5, 2, 64, 64) for _ in range(2)]
    ch = channel("tcp", lis.port)
    ch._pool = pool = BufferPool(pool_bytes)
    push(ch, f"tcp-{pool_bytes}", caches, (3, 1, 4), [(0, 64), (64, 150)])
    assert settle(ch, f"tcp-{pool_bytes}") == "complete"
    assert pool.allocated <= pool_bytes and (pool.allocated > 0) == (pool_bytes > 0)
    rec = ch.poll(f"tcp-{pool_bytes}").record  # who copied: the caller, or the sender thread
    assert (rec.copy_forward_s > 0, rec.sender_layers_s > 0) == (
        (True, False) if pool_bytes else (False, True))
    staged = staging.claim(f"tcp-{pool_bytes}")
    assert staged is not None
    assert_staged_equals(staging, staged, caches, (3, 1, 4), ((0, 64), (64, 150)))
    staging.release(staged, "loaded")
    ch.close()


def test_buffer_pool_reuses_and_bounds() -> None:
    pool = BufferPool(1000)
    a = pool.take(600)
    assert a is not None and a.numel() == 600
    assert pool.take(500) is None  # 1,100 > 1,000 allocated
    pool.give(a)
    assert pool.take(400) is a  # a free buffer that fits is reused, not a new one
    pool.give(a)
    b = pool.take(900)  # none fits: the free 600 is dropped to make room
    assert b is not None and b is not a and pool.allocated == 900


def test_a_failing_copy_fails_its_transfer_not_the_caller(
        listener: tuple[KVListener, StagingArea]) -> None:
    """A copy that raises on the forward thread (here: block ids that do not cover the chunk)
    settles the transfer as failed and D frees its region; push_layer itself returns."""
    lis, staging = listener
    ch = channel("shm", lis.port)
    st = ch.begin("bad-blocks", 200, SHAPE.transfer_bytes(200), ack_timeout_s=5.0)
    assert st.began.wait(5.0)
    layout = VllmCpuLayout(torch.randn(2, 2, 64, 64))
    ch.push_layer(LayerItem("bad-blocks", 0, 0, 200, layout, (0,)))
    ch.end("bad-blocks")
    assert settle(ch, "bad-blocks") == "failed"
    assert ch.poll("bad-blocks").record.cause == "internal_error"
    deadline = time.monotonic() + 5.0
    while staging.state()["staged_bytes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.state()["staged_bytes"] == 0
    assert staging.final_status("bad-blocks") == "aborted"  # P gave it up
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_transfer_past_its_ack_deadline_frees_ds_region_at_once(
        listener: tuple[KVListener, StagingArea], kind: str) -> None:
    """P's sender is behind (0.2 s a layer) when the transfer's ACK deadline passes: P fails it
    (`ack_timeout`) and its END never goes, so P ABORTs it and D frees its region then, not
    when its 30 s lease ends."""
    lis, staging = listener
    caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
    ch = channel(kind, lis.port, Faults(enabled=True))
    tid = "late-fault-delay"
    ch.begin(tid, 200, SHAPE.transfer_bytes(200), ack_timeout_s=0.3)
    for s, e in ((0, 100), (100, 200)):
        for layer, cache in enumerate(caches):
            ch.push_layer(LayerItem(tid, layer, s, e, VllmCpuLayout(cache), (0, 1, 2, 3)))
    ch.end(tid)
    assert settle(ch, tid) == "failed"
    assert ch.poll(tid).record.cause == "ack_timeout"
    deadline = time.monotonic() + 5.0
    while staging.final_status(tid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.final_status(tid) == "aborted"
    assert staging.state()["staged_bytes"] == 0
    staging.check_integrity()
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_p_aborting_one_of_two_open_transfers_frees_that_one_only(
        listener: tuple[KVListener, StagingArea], kind: str) -> None:
    """Two transfers open on one connection; P aborts the first after beginning the second. D
    frees the aborted one's region at once, and still takes the second as being written: it
    completes intact, and once loaded nothing stays staged."""
    lis, staging = listener
    torch.manual_seed(3)
    caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
    ch = channel(kind, lis.port)
    first = ch.begin("first", 120, SHAPE.transfer_bytes(120), ack_timeout_s=5.0)
    second = ch.begin("second", 120, SHAPE.transfer_bytes(120), ack_timeout_s=5.0)
    assert first.began.wait(5.0) and second.began.wait(5.0)
    ch.cancel("first")
    deadline = time.monotonic() + 5.0
    while staging.final_status("first") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.final_status("first") == "aborted"
    assert staging.state()["staged_bytes"] == SHAPE.transfer_bytes(120)  # the second's alone
    mid = staging.claim("second")
    assert mid is not None and not mid.writer_done  # P may still write it
    for layer, cache in enumerate(caches):
        ch.push_layer(LayerItem("second", layer, 0, 120, VllmCpuLayout(cache), (2, 0)))
    ch.end("second")
    assert settle(ch, "second") == "complete"
    assert mid.complete
    assert_staged_equals(staging, mid, caches, (2, 0), ((0, 120),))
    staging.release(mid, "loaded")
    assert staging.state()["staged_bytes"] == 0
    staging.check_integrity()
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_copy_failing_on_the_sender_thread_fails_its_transfer_alone(
        listener: tuple[KVListener, StagingArea], kind: str) -> None:
    """A layer the sender thread copies itself (here: a fault-delayed one) raises in its gather
    (block ids that do not cover the chunk): that transfer fails and D frees its region, and
    the channel goes on: the next transfer on it arrives intact."""
    lis, staging = listener
    caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
    ch = channel(kind, lis.port, Faults(enabled=True))
    ch.begin("bad-fault-delay", 100, SHAPE.transfer_bytes(100), ack_timeout_s=5.0)
    ch.push_layer(LayerItem("bad-fault-delay", 0, 0, 100, VllmCpuLayout(caches[0]), (0, 99)))
    ch.end("bad-fault-delay")
    assert settle(ch, "bad-fault-delay") == "failed"
    assert ch.poll("bad-fault-delay").record.cause == "internal_error"
    push(ch, "after", caches, (0, 1), [(0, 100)])
    assert settle(ch, "after") == "complete"
    st = staging.claim("after")
    assert st is not None and st.complete
    assert_staged_equals(staging, st, caches, (0, 1), ((0, 100),))
    staging.release(st, "loaded")
    assert staging.final_status("bad-fault-delay") == "aborted"
    assert staging.state()["staged_bytes"] == 0
    ch.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_transfer_p_aborts_after_d_opened_it_ends_aborted_for_the_router(
        listener: tuple[KVListener, StagingArea], kind: str) -> None:
    """P gives up on a transfer D has opened (here: its engine cancels it mid-push): D's record
    ends `aborted`, keeping the cause, its staging says so to a late decode request, and the
    router's leg protocol reads the record as final (it stops asking D)."""
    lis, staging = listener
    answers = ControlAnswers(ConnectorConfig(role="decode"), "d-engine", "v", FP, staging.stats,
                             staging, lambda: 0, lambda: 0)
    ch = channel(kind, lis.port)
    st = ch.begin("given-up", 10, SHAPE.transfer_bytes(10), ack_timeout_s=5.0)
    assert st.began.wait(5.0) and st.offset >= 0  # D opened it
    ch.cancel("given-up")
    deadline = time.monotonic() + 5.0
    while staging.final_status("given-up") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    raw = answers.answer(Query("transfer", "given-up"))  # what D's record route serves
    assert (raw["recv"]["status"], raw["recv"]["cause"]) == ("aborted", "aborted_by_prefill")
    assert staging.final_status("given-up") == "aborted"
    assert staging.state()["staged_bytes"] == 0
    record = SideRecord.from_json(raw["recv"])
    assert record.final and SplitserveLegs(None, None).record_final(record)  # type: ignore[arg-type]
    ch.close()
