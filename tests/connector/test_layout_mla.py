"""vLLM-CPU's latent (MLA) cache: paged <-> staging copies checked against the CPU MLA
backend's own cache write, the factory's choice, and the latent's staging size."""

from __future__ import annotations

import pytest
import torch

from splitserve.connector.layout import cpu_mla
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


@pytest.mark.parametrize(("start", "end", "base"),
                         [(0, 64, 0), (3, 61, 3), (16, 48, 16), (5, 20, 5), (11, 61, 8),
                          (24, 40, 1)])
@pytest.mark.parametrize("src_ids", [(17, 2, 9, 4, 13, 0, 11, 6), (4, 5, 6, 13, 0, 1, 2, 3)])
def test_scattered_blocks_gather_row_by_row(start: int, end: int, base: int,
                                            src_ids: tuple[int, ...],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole latent blocks scattered over the cache, in no order, gathered by one indexed copy
    (with a partial block at either end) into rows that begin at token `base`, land row by row
    where the staging format says, and rows before `start` are not written; the indexed copy
    runs exactly when two or more whole blocks are not consecutive."""
    torch.manual_seed(4)
    bs, width = 8, 6
    src = torch.randn(20, bs, width)
    indexed = []
    gather_whole = cpu_mla._gather_whole_blocks
    monkeypatch.setattr(cpu_mla, "_gather_whole_blocks",
                        lambda *a: indexed.append(a[2]) or gather_whole(*a))
    layout = VllmCpuMlaLayout(src)
    region = torch.full(((end - base) * width,), 7.0)
    layout.gather(src_ids, start, end, region.view(torch.uint8)[(start - base) * width * 4:])
    rows = region.view(end - base, width)
    whole = src_ids[-(-start // bs):end // bs]
    assert indexed == ([whole] if len(whole) > 1 and list(whole) != list(
        range(whole[0], whole[0] + len(whole))) else [])
    assert (rows[:start - base] == 7).all()
    for t in range(start, end):
        assert torch.equal(rows[t - base], src[src_ids[t // bs], t % bs]), t


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
