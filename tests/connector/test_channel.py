"""P's push channel into D's listener, in one process: bytes land where the loader reads them,
over both transports; corruption, refusal and a vanished peer settle the transfer as failed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from channels import FP, SHAPE, assert_staged_equals, push, settle

from splitserve.connector.faults import Faults
from splitserve.connector.listener import KVListener
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel

TOKEN = "channel-test-token-0123456789"
CHANNELS = {"tcp": TcpPushChannel, "shm": ShmPushChannel}


@pytest.fixture
def listener() -> Iterator[tuple[KVListener, StagingArea]]:
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {"echo": q})
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
    assert settle(ch, f"ok-{kind}") == "acked"
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


def test_wrong_token_never_stages(listener: tuple[KVListener, StagingArea]) -> None:
    lis, staging = listener
    ch = TcpPushChannel("127.0.0.1", lis.port, "not-the-token", FP, ConnectorStats(),
                        Faults(False), SHAPE, 2.0)
    push(ch, "intruder", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "intruder") == "failed"
    assert ch.poll("intruder").record.cause == "peer_refused"
    assert staging.state()["staged_bytes"] == 0 and staging.final_status("intruder") is None
    ch.close()


def test_vanished_peer_fails_pending_transfers() -> None:
    ch = channel("tcp", 9)  # nothing listens on the discard port
    push(ch, "lost", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "lost") == "failed"
    assert ch.poll("lost").record.cause == "peer_unreachable"
    ch.close()
