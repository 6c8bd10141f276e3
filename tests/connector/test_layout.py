"""Paged <-> staging copies, checked against vLLM's own CPU cache-write kernel."""

from __future__ import annotations

import pytest
import torch

from splitserve.connector.layout import (
    KVShape,
    block_runs,
    chunk_views,
    copy_tokens,
    paged_kv,
    region_offset,
    verify_paged_layout,
)


def test_layout_matches_vllm_kernel() -> None:
    verify_paged_layout(torch.zeros(4, 2, 128, 128))  # raises if vLLM wrote elsewhere


def test_block_runs_merge_whole_consecutive_blocks() -> None:
    assert block_runs([7, 8, 9, 2], 4, 0, 14) == [(7, 3, 0, 0, 12), (2, 1, 0, 12, 2)]
    assert block_runs([7, 8, 9], 4, 2, 9) == [(7, 1, 2, 2, 2), (8, 1, 0, 4, 4), (9, 1, 0, 8, 1)]


@pytest.mark.parametrize(("start", "end"), [(0, 300), (5, 130), (100, 400), (0, 128), (3, 4)])
def test_roundtrip_between_block_sizes(start: int, end: int) -> None:
    """Rows gathered from 128-token blocks land correctly in 32-token blocks."""
    torch.manual_seed(0)
    src = torch.randn(8, 2, 128, 128)
    src_ids = [3, 4, 5, 1]
    dst = torch.zeros(40, 2, 32, 128)
    dst_ids = list(range(39, 0, -1))
    n = end - start
    k_rows, v_rows = torch.empty(2, 64, n), torch.empty(2, n, 64)
    ks, vs = paged_kv(src)
    kd, vd = paged_kv(dst)
    copy_tokens(ks, vs, src_ids, k_rows, v_rows, start, end, start, to_paged=False)
    copy_tokens(kd, vd, dst_ids, k_rows, v_rows, start, end, start, to_paged=True)
    for t in range(start, end):
        bs, os_ = divmod(t, 128)
        bd, od = divmod(t, 32)
        assert torch.equal(kd[dst_ids[bd], :, :, od], ks[src_ids[bs], :, :, os_])
        assert torch.equal(vd[dst_ids[bd], :, od], vs[src_ids[bs], :, os_])


def test_region_offsets_tile_the_transfer() -> None:
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    chunks = [(0, 100), (100, 256), (256, 300)]
    spans = sorted((region_offset(shape, s, e, layer), (e - s) * shape.bytes_per_token_layer)
                   for s, e in chunks for layer in range(3))
    pos = 0
    for off, size in spans:
        assert off == pos
        pos += size
    assert pos == shape.transfer_bytes(300)


def test_chunk_views_split_k_and_v() -> None:
    region = torch.arange(2 * 2 * 5 * 4, dtype=torch.float32)
    k, v = chunk_views(region, heads=2, head_dim=4, n=5)
    assert k.shape == (2, 4, 5) and v.shape == (2, 5, 4)
    assert k.flatten()[0] == 0 and v.flatten()[0] == 40
