"""P's push channel into D's listener, in one process: bytes land where the loader reads them,
over both transports; corruption, refusal and a vanished peer settle the transfer as failed.
P giving a transfer up is test_channel_giving_up.py."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from splitserve.connector.faults import Faults
from splitserve.connector.framing import ProtocolError
from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.listener import KVListener
from splitserve.connector.protocol import (
    KEEPALIVE_IDLE_S,
    KEEPALIVE_PROBES,
    UNACKED_TIMEOUT_S,
    connect,
)
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats, TransferRecord
from splitserve.connector.transport.items import LayerItem
from splitserve.connector.transport.tcp import BufferPool, TcpPushChannel
from tests.support.channels import (
    FP,
    SHAPE,
    TOKEN,
    assert_staged_equals,
    channel,
    push,
    settle,
    staged_region,
)


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


def test_both_ends_of_a_kv_connection_watch_for_a_vanished_peer(
        listener: tuple[KVListener, StagingArea]) -> None:
    """A peer whose host died sends nothing, not even a FIN: both ends probe an idle connection
    and bound unacknowledged bytes, so D's read and P's write fail instead of blocking for ever
    (D's staged region, P's engine thread)."""
    lis, _ = listener
    sock, _ = connect("127.0.0.1", lis.port, TOKEN, "push", FP, 5.0)
    with sock:
        deadline = time.monotonic() + 5
        while not lis._conns and time.monotonic() < deadline:  # the listener's end, accepted
            time.sleep(0.01)
        (served,) = list(lis._conns)
        for end in (sock, served):
            assert isinstance(end, socket.socket)
            assert end.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
            assert (end.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
                    == UNACKED_TIMEOUT_S * 1000)


def test_d_has_the_ack_timeout_from_the_end_however_long_the_prefill_took(
        listener: tuple[KVListener, StagingArea]) -> None:
    """P's ACK deadline runs from its last layer: a prefill longer than the ACK timeout is
    acknowledged, not given up on at P's first poll after it."""
    lis, _ = listener
    ch = channel("tcp", lis.port)
    caches = [torch.randn(2, 2, 64, 64)] * 2
    ch.begin("long", 10, SHAPE.transfer_bytes(10), ack_timeout_s=0.3)
    time.sleep(0.5)  # the prefill outlasts the ACK timeout
    for layer, cache in enumerate(caches):
        ch.push_layer(LayerItem("long", layer, 0, 10, VllmCpuLayout(cache), (0,)))
    ch.end("long")
    assert settle(ch, "long") == "complete"
    ch.close()


def test_the_listener_outlives_a_connection_it_had_no_thread_for(
        listener: tuple[KVListener, StagingArea], monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that cannot be started (the process is out of them) costs that connection
    only: the accept loop goes on serving the next."""
    lis, _ = listener
    start = threading.Thread.start
    refused: list[str] = []

    def start_or_refuse(thread: threading.Thread) -> None:
        if thread.name == "splitserve-kv-conn" and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    with pytest.raises((OSError, ProtocolError)):
        connect("127.0.0.1", lis.port, TOKEN, "push", FP, 5.0)
    sock, _ = connect("127.0.0.1", lis.port, TOKEN, "push", FP, 5.0)
    sock.close()
    assert refused == ["splitserve-kv-conn"]


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_push_that_outlasts_the_lease_is_not_reaped_while_it_moves(kind: str) -> None:
    """D's lease bounds KV complete and unclaimed; a prefill longer than it keeps its transfer
    (over shm D hears of its layers only at END)."""
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=0.3, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {})
    ch = channel(kind, lis.port)
    try:
        caches = [torch.randn(4, 2, 64, 64) for _ in range(2)]
        ch.begin("long", 150, SHAPE.transfer_bytes(150), ack_timeout_s=10.0)
        for s, e in ((0, 50), (50, 100), (100, 150)):  # chunks 0.25 s apart: 0.75 s in all
            time.sleep(0.25)
            for layer, cache in enumerate(caches):
                ch.push_layer(LayerItem("long", layer, s, e, VllmCpuLayout(cache), (0, 1, 2, 3)))
        ch.end("long")
        assert settle(ch, "long") == "complete"
    finally:
        ch.close()
        lis.close()
        staging.close()
