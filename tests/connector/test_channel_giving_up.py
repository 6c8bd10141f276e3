"""P giving a transfer up, in one process: a copy that fails (on the forward thread or the
sender's), a cancel, its ACK deadline, an abort among several transfers open on one connection.
D frees the region at once and its record says why; the channel goes on with the next."""

from __future__ import annotations

import threading
import time
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
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.items import LayerItem
from splitserve.connector.transport.tcp import TcpPushChannel
from splitserve.router.legs.splitserve import SplitserveLegs
from tests.support.channels import (
    FP,
    NO_FAULTS,
    SHAPE,
    TOKEN,
    assert_staged_equals,
    channel,
    push,
    settle,
)


def final_status(staging: StagingArea, tid: str, timeout_s: float = 5.0) -> str | None:
    """D's terminal status of `tid`, once it has one (None if none came in `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while staging.final_status(tid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return staging.final_status(tid)


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
    assert final_status(staging, "early") == "aborted"  # P gave it up
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
    assert final_status(staging, "slow") == "aborted" and staging.state()["staged_bytes"] == 0
    ch.close()


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
    assert final_status(staging, tid) == "aborted"
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
    assert final_status(staging, "first") == "aborted"
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
    deadline = time.monotonic() + 5.0  # the cause is written just after the status
    while ch.poll("bad-fault-delay").record.cause is None and time.monotonic() < deadline:
        time.sleep(0.01)
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
