"""Paged <-> staging copies, checked against vLLM's own CPU cache-write kernel; the layout
factory's choice, and its refusal of caches it cannot read (vLLM 0.32's CUDA caches)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from splitserve.connector.layout import cpu as cpu_layout
from splitserve.connector.layout.cpu import (
    VllmCpuLayout,
    block_runs,
    copy_tokens,
    paged_kv,
)
from splitserve.connector.layout.paged import EngineKV, UnsupportedKVCache
from splitserve.connector.layout.select import select_layouts
from splitserve.connector.layout.staging_format import KVShape, chunk_views, region_offset

CPU = EngineKV("cpu", ("CPU_ATTN",), "LBHNC", spec_kinds=("FullAttentionSpec",))


def test_layout_matches_vllm_kernel() -> None:
    VllmCpuLayout.verify(torch.zeros(4, 2, 128, 128), CPU)  # raises if vLLM wrote elsewhere


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


@pytest.mark.parametrize(("start", "end", "base"),
                         [(0, 64, 0), (3, 61, 3), (16, 48, 16), (5, 20, 5), (0, 16, 0),
                          (11, 61, 8), (24, 40, 1)])
@pytest.mark.parametrize("src_ids", [(17, 2, 9, 4, 13, 0, 11, 6), (4, 5, 6, 13, 0, 1, 2, 3)])
def test_scattered_blocks_gather_and_scatter_token_by_token(
        start: int, end: int, base: int, src_ids: tuple[int, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole blocks scattered over the cache, in no order, gathered by one indexed copy (with a
    partial block at either end) into rows that begin at token `base`, and scattered back by
    runs, land token by token where the staging format says; rows before `start` and blocks
    outside [start, end) are not written."""
    torch.manual_seed(3)
    bs, heads, dim = 8, 2, 4
    src = torch.randn(20, heads, bs, 2 * dim)
    dst_ids = (5, 14, 1, 19, 8, 3, 16, 10)
    indexed = []
    gather_whole = cpu_layout._gather_whole_blocks
    monkeypatch.setattr(cpu_layout, "_gather_whole_blocks",
                        lambda *a: indexed.append(a[2]) or gather_whole(*a))
    n = end - base
    k_rows, v_rows = torch.full((heads, dim, n), 7.0), torch.full((heads, n, dim), 7.0)
    (ks, vs), dst = paged_kv(src), torch.zeros(20, heads, bs, 2 * dim)
    kd, vd = paged_kv(dst)
    copy_tokens(ks, vs, src_ids, k_rows, v_rows, start, end, base, to_paged=False)
    copy_tokens(kd, vd, dst_ids, k_rows, v_rows, start, end, base, to_paged=True)
    whole = src_ids[-(-start // bs):end // bs]
    assert indexed == ([whole] if len(whole) > 1 and list(whole) != list(
        range(whole[0], whole[0] + len(whole))) else [])
    assert (k_rows[:, :, :start - base] == 7).all() and (v_rows[:, :start - base] == 7).all()
    for t in range(start, end):
        b, slot = divmod(t, bs)
        assert torch.equal(k_rows[:, :, t - base], ks[src_ids[b], :, :, slot])
        assert torch.equal(v_rows[:, t - base], vs[src_ids[b], :, slot])
        assert torch.equal(kd[dst_ids[b], :, :, slot], ks[src_ids[b], :, :, slot])
        assert torch.equal(vd[dst_ids[b], :, slot], vs[src_ids[b], :, slot])
    written = {dst_ids[t // bs] for t in range(start, end)}
    assert not any(dst[b].any() for b in range(20) if b not in written)


def test_layout_gather_is_the_staging_format_and_scatter_skips_known_tokens() -> None:
    """`gather` writes K [H, D, n] then V [H, n, D] element by element as the staging format
    says; `scatter` with region_start < start writes only [start, end) into the blocks."""
    torch.manual_seed(2)
    src, dst = torch.randn(6, 2, 16, 8), torch.zeros(9, 2, 32, 8)
    p, d = VllmCpuLayout(src), VllmCpuLayout(dst)
    src_ids, dst_ids = [5, 0, 3, 2], [8, 1, 4]
    start, end, skip = 7, 60, 20
    region = torch.empty((end - start) * p.bytes_per_token, dtype=torch.uint8)
    p.gather(src_ids, start, end, region)
    k_rows, v_rows = chunk_views(region.view(torch.float32), 2, 4, end - start)
    for t in range(start, end):
        block, slot = src_ids[t // 16], t % 16
        for h in range(2):
            k_block, v_block = src[block, h].view(-1).split(64)
            assert torch.equal(k_rows[h, :, t - start], k_block.view(4, 16)[:, slot])
            assert torch.equal(v_rows[h, t - start], v_block.view(16, 4)[slot])
    d.scatter(dst_ids, skip, end, region, start)
    kd, vd = paged_kv(dst)
    for t in range(0, 96):
        block, slot = dst_ids[t // 32], t % 32
        if skip <= t < end:
            assert torch.equal(kd[block, :, :, slot], k_rows[:, :, t - start])
            assert torch.equal(vd[block, :, slot], v_rows[:, t - start])
        else:
            assert not kd[block, :, :, slot].any() and not vd[block, :, slot].any()
    assert d.holds(dst) and not d.holds(src) and (p.block_size, d.block_size) == (16, 32)


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


def test_factory_chooses_the_cpu_layout_for_every_layer() -> None:
    caches = [(f"model.layers.{i}.self_attn.attn", torch.zeros(4, 2, 32, 128)) for i in range(3)]
    layouts = select_layouts(caches, CPU)
    assert [type(lay) for lay in layouts] == [VllmCpuLayout] * 3
    assert all(lay.holds(c) for lay, (_, c) in zip(layouts, caches, strict=True))
    assert (layouts[0].num_kv_heads, layouts[0].head_dim, layouts[0].block_size) == (2, 64, 32)


def cuda_layer_view(layout: KVCacheLayout, nb: int = 8, heads: int = 4, bs: int = 16,
                    head_dim: int = 64) -> torch.Tensor:
    """A layer's cache as vLLM 0.32 hands it to a CUDA attention backend: the logical view
    [B, H, N, 2*D] of memory allocated in `layout`'s physical order (`create_kv_cache_views`)."""
    logical = (nb, heads, bs, 2 * head_dim)
    order = layout.layer_view_order
    physical = torch.zeros(tuple(logical[i] for i in order))
    return physical.permute(*[order.index(i) for i in range(4)])


def refusal(caches: list[tuple[str, torch.Tensor]], engine: EngineKV) -> str:
    with pytest.raises(UnsupportedKVCache) as err:
        select_layouts(caches, engine)
    msg = str(err.value)
    assert "unpack" not in msg and "NixlConnector" in msg and "vLLM-CPU" in msg
    return msg


def test_generic_cuda_cache_is_refused_naming_its_shape() -> None:
    """vLLM's generic CUDA allocation (num_blocks, 2, block_size, kv_heads, head_size)."""
    msg = refusal([("layers.0.attn", torch.zeros(8, 2, 16, 4, 64))],
                  EngineKV("cuda", ("FLASH_ATTN",), "LBNHC"))
    assert "(8, 2, 16, 4, 64)" in msg and "FLASH_ATTN" in msg and "cuda" in msg


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_cuda_layer_views_off_a_cuda_device_are_refused(layout: KVCacheLayout, backend: str
                                                        ) -> None:
    """A CUDA backend's layer view, in either block interior, even one whose shape and strides
    equal the CPU cache's (LBHNC), is read only as what it is (a CUDA tensor of a CUDA engine,
    see test_device_path): the backend's K/V order differs, so shape alone never decides."""
    cache = cuda_layer_view(layout)
    msg = refusal([("layers.0.attn", cache)], EngineKV("cuda", (backend,), layout.name))
    assert "(8, 4, 16, 128)" in msg and str(tuple(cache.stride())) in msg and backend in msg
    refusal([("layers.0.attn", cache)], EngineKV("cpu", (backend,), layout.name))


def test_latent_and_hybrid_caches_are_refused() -> None:
    msg = refusal([("layers.0.attn", torch.zeros(8, 16, 576))],
                  EngineKV("cpu", ("CPU_ATTN",), "LBHNC", use_mla=True))
    assert "(8, 16, 576)" in msg and "MLA" in msg
    mixed = [("layers.0.attn", torch.zeros(4, 2, 32, 128)), ("layers.1.mixer", torch.zeros(4, 64))]
    msg = refusal(mixed, EngineKV("cpu", ("CPU_ATTN",), "LBHNC",
                                  spec_kinds=("FullAttentionSpec", "MambaSpec")))
    assert "MambaSpec" in msg


def test_caches_in_several_groups_are_refused() -> None:
    """Sliding-window and full-attention layers in two groups: each group has its own block
    table, and the connector moves one per request, so the worker refuses at start-up."""
    caches = [(f"layers.{i}.attn", torch.zeros(4, 2, 32, 128)) for i in range(2)]
    engine = EngineKV("cpu", ("CPU_ATTN",), "LBHNC",
                      spec_kinds=("FullAttentionSpec", "SlidingWindowSpec"), kv_cache_groups=2)
    msg = refusal(caches, engine)
    assert "2 groups" in msg and "2 KV cache groups" in msg and "NixlConnector" in msg
    assert "--no-disable-hybrid-kv-cache-manager" in msg
    assert select_layouts(caches, EngineKV("cpu", ("CPU_ATTN",), "LBHNC"))  # one group: read
