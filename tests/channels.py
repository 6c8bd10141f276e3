"""Helpers for the in-process channel tests: a small KV shape, pushing a transfer, waiting for
it to settle, and checking that the staged bytes are the pushed KV."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.layout.staging_format import KVShape, region_offset
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.staging import StagedTransfer, StagingArea
from splitserve.connector.transport.base import LayerItem, PushChannel

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
FP = Fingerprint("cafe", "float32", 2, 2, 32, "0.32.0")


def push(ch: PushChannel, tid: str, caches: list[torch.Tensor], blocks: tuple[int, ...],
         chunks: list[tuple[int, int]]) -> None:
    n = chunks[-1][1]
    ch.begin(tid, n, SHAPE.transfer_bytes(n), ack_timeout_s=5.0)
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


def staged_region(staging: StagingArea, offset: int, start: int, end: int, layer: int
                  ) -> torch.Tensor:
    """D's staging bytes (uint8) of chunk [start, end) of `layer`, for a transfer at `offset`."""
    base = offset + region_offset(SHAPE, start, end, layer)
    return staging.segment.tensor[base:base + (end - start) * SHAPE.bytes_per_token_layer]


def assert_staged_equals(staging: StagingArea, st: StagedTransfer, caches: list[torch.Tensor],
                         blocks: tuple[int, ...], chunks: Sequence[tuple[int, int]]) -> None:
    """Every chunk of every layer in D's staging area equals P's paged KV, token for token."""
    for layer, cache in enumerate(caches):
        layout = VllmCpuLayout(cache)
        for s, e in chunks:
            staged = staged_region(staging, st.offset, s, e, layer)
            ref = torch.empty_like(staged)
            layout.gather(blocks, s, e, ref)
            assert torch.equal(staged, ref)
