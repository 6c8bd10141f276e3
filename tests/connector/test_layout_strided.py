"""vLLM's CUDA paged layouts (`layout.strided`) on CPU tensors strided as CUDA's: round trips
against a reference read element by element, the allocation against vLLM's own, the start-up
write-path check, and the CPU copier."""

from __future__ import annotations

import random

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from splitserve.connector.devcopy import InFlightBudget, InlineCopies
from splitserve.connector.layout.strided import (
    LAYOUTS,
    StridedKV,
    allocate_views,
    layer_view_order,
    matches,
    verify_write_path,
)

H, D = 2, 4


def _filled(name: str, layers: int, blocks: int, bs: int, dtype: torch.dtype = torch.float32
            ) -> list[torch.Tensor]:
    views = allocate_views(name, layers, blocks, H, bs, D, dtype)
    gen = torch.Generator().manual_seed(len(name) + bs)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    return views


def _reference(cache: torch.Tensor, block_ids: list[int], start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """K [H, D, n] and V [H, n, D] read one element at a time from the logical view."""
    bs, n = cache.shape[2], end - start
    k = torch.empty((H, D, n), dtype=cache.dtype)
    v = torch.empty((H, n, D), dtype=cache.dtype)
    for t in range(start, end):
        b, s = block_ids[t // bs], t % bs
        for h in range(H):
            for d in range(D):
                k[h, d, t - start] = cache[b, h, s, d]
                v[h, t - start, d] = cache[b, h, s, D + d]
    return k, v


def _split(region: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    e = region.view(dtype)
    return e[:H * D * n].view(H, D, n), e[H * D * n:].view(H, n, D)


def test_layout_table_is_vllms() -> None:
    assert LAYOUTS == {m.name: m.value for m in KVCacheLayout}
    for m in KVCacheLayout:
        assert layer_view_order(m.name) == m.layer_view_order


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_views_are_strided_as_vllm_allocates_them(name: str) -> None:
    layers, blocks, bs = 3, 5, 4
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    layout = KVCacheLayout[name]
    strides = compute_layout_strides(spec, blocks, layers, layout)
    size = layers * blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    theirs = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, blocks, layout,
                                   tensor)
    ours = allocate_views(name, layers, blocks, H, bs, D, torch.bfloat16)
    for a, b in zip(theirs, ours, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
    assert all(matches(v, name) for v in ours)
    others = [o for o in LAYOUTS if layer_view_order(o) != layer_view_order(name)]
    assert not any(matches(ours[0], o) for o in others)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_element_reference(name: str, dtype: torch.dtype) -> None:
    bs = 4
    cache = _filled(name, 2, 9, bs, dtype)[1]
    rng = random.Random(1)
    block_ids = rng.sample(range(9), 6)  # random, non-consecutive block table
    layer = StridedKV(cache)
    for start, end in [(0, 24), (3, 9), (4, 8), (5, 6), (7, 21), (0, 1), (23, 24)]:
        region = torch.empty((end - start) * layer.bytes_per_token, dtype=torch.uint8)
        layer.gather(block_ids, start, end, region)
        k, v = _split(region, end - start, dtype)
        k_ref, v_ref = _reference(cache, block_ids, start, end)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), (start, end)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scatter_writes_only_its_slots(name: str) -> None:
    bs = 4
    src = _filled(name, 2, 8, bs)[0]
    dst = allocate_views(name, 2, 8, H, bs, D, torch.float32)[0]
    ids = [6, 1, 3, 4, 0]
    layer_src, layer_dst = StridedKV(src), StridedKV(dst)
    region = torch.empty(18 * layer_src.bytes_per_token, dtype=torch.uint8)
    layer_src.gather(ids, 0, 18, region)
    # D already holds tokens [0, 5): the region's first five are skipped
    layer_dst.scatter(ids, 5, 18, region, 0)
    for t in range(18):
        b, s = ids[t // bs], t % bs
        assert torch.equal(dst[b, :, s], src[b, :, s] if t >= 5 else torch.zeros(H, 2 * D))
    untouched = [b for b in range(8) if b not in ids]
    assert not dst[untouched].any()


@pytest.mark.parametrize(("p_layout", "p_bs", "d_layout", "d_bs"), [
    ("LBNHC", 16, "LBHNC", 4), ("BLHNC", 4, "LBNHC", 16), ("LHBNC", 8, "BHLNC", 2),
    ("BLNHC", 2, "BLNHC", 8)])
def test_p_and_d_differ_in_block_size_and_layout(p_layout: str, p_bs: int, d_layout: str,
                                                 d_bs: int) -> None:
    tokens, chunk = 37, 11
    p_cache = _filled(p_layout, 2, tokens // p_bs + 3, p_bs, torch.bfloat16)[1]
    d_cache = allocate_views(d_layout, 2, tokens // d_bs + 4, H, d_bs, D, torch.bfloat16)[1]
    rng = random.Random(p_bs * 31 + d_bs)
    p_ids = rng.sample(range(p_cache.shape[0]), -(-tokens // p_bs))
    d_ids = rng.sample(range(d_cache.shape[0]), -(-tokens // d_bs))
    p, d = StridedKV(p_cache), StridedKV(d_cache)
    for start in range(0, tokens, chunk):  # chunks as P's prefill steps computed them
        end = min(start + chunk, tokens)
        region = torch.empty((end - start) * p.bytes_per_token, dtype=torch.uint8)
        p.gather(p_ids, start, end, region)
        d.scatter(d_ids, start, end, region, start)
    for t in range(tokens):
        assert torch.equal(p_cache[p_ids[t // p_bs], :, t % p_bs],
                           d_cache[d_ids[t // d_bs], :, t % d_bs]), t


def _reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM's `reshape_and_cache_flash` semantics (a CUDA kernel), element by element:
    token i goes to block slots[i] // N, slot slots[i] % N of `[B, N, H, D]` caches."""
    bs = k_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        k_cache[slot // bs, slot % bs] = key[i]
        v_cache[slot // bs, slot % bs] = value[i]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_write_path_check_accepts_the_engine_write_and_names_a_wrong_one(name: str) -> None:
    like = allocate_views(name, 1, 2, H, 4, D, torch.bfloat16)[0]
    assert verify_write_path(name, like, _reshape_and_cache_flash) is None

    def swapped(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        _reshape_and_cache_flash(value, key, k_cache, v_cache, slots)

    assert "K is not where" in str(verify_write_path(name, like, swapped))

    def heads_mirrored(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        _reshape_and_cache_flash(key, value.flip(1), k_cache, v_cache, slots)

    assert "V is not where" in str(verify_write_path(name, like, heads_mirrored))


def test_refuses_a_cache_that_is_not_standard_attention() -> None:
    with pytest.raises(ValueError, match="2\\*head_dim"):
        StridedKV(torch.zeros(4, 1, 16, 577))  # an MLA latent row (512 + 64 + 1) is odd
    with pytest.raises(ValueError, match="unit-stride"):
        StridedKV(torch.zeros(4, 2, 16, 8).transpose(2, 3))


def test_inline_copies_are_the_synchronous_copies() -> None:
    cache = _filled("LBNHC", 1, 6, 4)[0]
    layer, copies = StridedKV(cache), InlineCopies()
    ids = [5, 2, 0]
    region = torch.empty(10 * layer.bytes_per_token, dtype=torch.uint8)
    done = copies.save(layer, ids, 1, 11, region)
    assert done.done()
    done.wait()
    k, v = _split(region, 10, torch.float32)
    k_ref, v_ref = _reference(cache, ids, 1, 11)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    back = allocate_views("LBNHC", 1, 6, H, 4, D, torch.float32)[0]
    assert copies.load(StridedKV(back), ids, 1, 11, region, 1).done()
    for t in range(1, 11):
        assert torch.equal(back[ids[t // 4], :, t % 4], cache[ids[t // 4], :, t % 4])


def test_a_block_table_that_does_not_cover_the_range_is_refused_on_the_host() -> None:
    layer = StridedKV(allocate_views("LBNHC", 1, 4, H, 4, D, torch.float32)[0])
    region = torch.empty(8 * layer.bytes_per_token, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not cover"):
        layer.gather([1], 0, 8, region)
    with pytest.raises(ValueError, match="outside"):
        layer.gather([1, 4], 0, 8, region)


def test_the_cuda_copier_budget_bounds_bytes_in_flight() -> None:
    budget = InFlightBudget(100)
    assert budget.take(60) and not budget.take(50)  # 110 > 100 in flight
    budget.give(60)
    assert budget.take(250)  # alone in flight, one copy may exceed the bound
    assert not budget.take(1)
    budget.give(250)
    assert budget.used == 0
