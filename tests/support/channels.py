"""Helpers for the in-process channel tests: a small KV shape, a channel to D's listener
(`channel`; the listener is tests/connector/conftest.py's fixture), pushing a transfer, waiting
for it to settle, and checking that the staged bytes are the pushed KV; and `FakeChannel`, an
in-memory `TransferChannel` for unit tests of P's send bookkeeping: it records what the
bookkeeping asked for, gathers each pushed layer into bytes as a real channel would (the
staging format, through the item's layout), and settles transfers when the test says so."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.connector.faults import Faults
from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.layout.staging_format import KVShape, region_offset
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.staging import StagedTransfer, StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.items import LayerItem, SendState
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
FP = Fingerprint("cafe", "float32", 2, 2, 32, "0.32.0")
TOKEN = "channel-test-token-0123456789"
CHANNELS: dict[str, type[PushChannel]] = {"tcp": TcpPushChannel, "shm": ShmPushChannel}
NO_FAULTS = Faults(False)


def channel(kind: str, port: int, faults: Faults = NO_FAULTS) -> PushChannel:
    """A `kind` channel to D's listener on `port`, on this module's shape and token."""
    return CHANNELS[kind]("127.0.0.1", port, TOKEN, FP, ConnectorStats(), faults, SHAPE, 2.0)


def push(ch: PushChannel, tid: str, caches: list[torch.Tensor], blocks: tuple[int, ...],
         chunks: list[tuple[int, int]]) -> None:
    """Push the prompt tokens [chunks[0][0], chunks[-1][1]) chunk by chunk: a first chunk that
    starts after 0 skips the prefix before it, as P does when D's cache holds it."""
    skip, n = chunks[0][0], chunks[-1][1]
    ch.begin(tid, n, SHAPE.transfer_bytes(n - skip), ack_timeout_s=5.0, skip=skip)
    for s, e in chunks:
        for layer, cache in enumerate(caches):
            ch.push_layer(LayerItem(tid, layer, s, e, VllmCpuLayout(cache), blocks))
    ch.end(tid)


def settle(ch: PushChannel, tid: str, timeout_s: float = 8.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = ch.poll(tid)
        if st is not None and st.settled:
            return st.status
        time.sleep(0.01)
    raise AssertionError("transfer never settled")


def staged_region(staging: StagingArea, offset: int, start: int, end: int, layer: int,
                  skip: int = 0) -> torch.Tensor:
    """D's staging bytes (uint8) of chunk [start, end) of `layer`, for a transfer at `offset`
    whose first token is `skip`."""
    base = offset + region_offset(SHAPE, start, end, layer, skip)
    return staging.segment.tensor[base:base + (end - start) * SHAPE.bytes_per_token_layer]


def assert_staged_equals(staging: StagingArea, st: StagedTransfer, caches: list[torch.Tensor],
                         blocks: tuple[int, ...], chunks: Sequence[tuple[int, int]]) -> None:
    """Every chunk of every layer in D's staging area equals P's paged KV, token for token."""
    for layer, cache in enumerate(caches):
        layout = VllmCpuLayout(cache)
        for s, e in chunks:
            staged = staged_region(staging, st.offset, s, e, layer, st.skip)
            ref = torch.empty_like(staged)
            layout.gather(blocks, s, e, ref)
            assert torch.equal(staged, ref)


@dataclass
class Pushed:
    layer: int
    start: int
    end: int
    payload: bytes  # the chunk in the staging format, gathered when it was pushed


@dataclass
class FakeTransfer:
    state: SendState
    layers: list[Pushed] = field(default_factory=list)
    ended: bool = False


class FakeChannel:
    def __init__(self, host: str, port: int, transport: str) -> None:
        self.address = (host, port, transport)
        self.stats = ConnectorStats()
        self.transfers: dict[str, FakeTransfer] = {}
        self.cancelled: list[str] = []
        self.forgotten: list[str] = []
        self.closed = False
        self.connected = True  # the test sets False: the connection to D was lost

    def begin(self, transfer_id: str, num_tokens: int, nbytes: int, ack_timeout_s: float,
              skip: int = 0) -> SendState:
        rec = self.stats.open(transfer_id, "send", num_tokens - skip, nbytes, skip)
        st = SendState(transfer_id, num_tokens, rec, time.monotonic() + ack_timeout_s, skip)
        self.transfers[transfer_id] = FakeTransfer(st)
        return st

    def push_layer(self, item: LayerItem) -> None:
        region = torch.empty((item.end - item.start) * item.layout.bytes_per_token,
                             dtype=torch.uint8)
        item.gather_into(region)
        self.transfers[item.transfer_id].layers.append(
            Pushed(item.layer, item.start, item.end, region.numpy().tobytes()))

    def end(self, transfer_id: str) -> None:
        self.transfers[transfer_id].ended = True

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)
        self.settle(transfer_id, "cancelled")

    def poll(self, transfer_id: str) -> SendState | None:
        t = self.transfers.get(transfer_id)
        return t.state if t is not None else None

    def forget(self, transfer_id: str) -> None:
        self.forgotten.append(transfer_id)
        self.transfers.pop(transfer_id, None)

    def close(self) -> None:
        self.closed = True

    # -- the test's side ----------------------------------------------------------------------
    def settle(self, transfer_id: str, status: str) -> None:
        """What D's ACK (or a failure) does to a real channel's transfer."""
        self.transfers[transfer_id].state.status = status
