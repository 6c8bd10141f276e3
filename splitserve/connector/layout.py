"""KV layouts: vLLM's paged CPU cache on one side, splitserve's staging layout on the other.

Paged (vLLM CPU attention, ISA "vec"/"vec16"): one tensor per layer,
`[num_blocks, kv_heads, block_size, 2*head_dim]`. Within a block and head the first half holds
K *dimension-major* (`[head_dim, block_size]`), the second half V token-major
(`[block_size, head_dim]`). `verify_paged_layout` checks this against vLLM's own cache-write
kernel at start-up, so a layout change in vLLM is a clear error, not wrong tokens.

Staging (per transfer): chunk-major, then layer-major. A chunk is the token range one prefill
step computed; its region for one layer is `K [H, D, n]` then `V [H, n, D]` (token-contiguous
rows, so P and D need not share a block size). `region_offset` gives where (layer, chunk) lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def elem_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def layer_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token_layer

    def transfer_bytes(self, num_tokens: int) -> int:
        return self.num_layers * self.layer_bytes(num_tokens)

    def row_offset(self, num_tokens: int, layer: int, kv: int, head: int, token: int) -> int:
        """Byte offset of (layer, kv, head, token) inside a transfer's staging region."""
        row = (kv * self.num_kv_heads + head) * num_tokens + token
        return layer * self.layer_bytes(num_tokens) + row * self.head_dim * self.elem_bytes


BlockIds = list[int] | tuple[int, ...]


def region_offset(shape: KVShape, start: int, end: int, layer: int) -> int:
    """Byte offset of (layer, chunk [start, end)) in a transfer's staging region.

    Valid because chunks partition [0, num_tokens) in order and every layer sees the same chunks.
    """
    return (start * shape.num_layers + layer * (end - start)) * shape.bytes_per_token_layer


def paged_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views K `[nb, H, D, bs]` and V `[nb, H, bs, D]` of one layer's paged cache."""
    nb, h, bs, d2 = kv_cache.shape
    if not kv_cache.is_contiguous() or d2 % 2:
        raise ValueError(f"unexpected paged KV layout {tuple(kv_cache.shape)}")
    halves = kv_cache.view(nb, h, 2, bs * (d2 // 2))
    return halves[:, :, 0].view(nb, h, d2 // 2, bs), halves[:, :, 1].view(nb, h, bs, d2 // 2)


def chunk_views(region: torch.Tensor, heads: int, head_dim: int, n: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A (layer, chunk) staging region (1-D, the KV dtype) as K `[H, D, n]` and V `[H, n, D]`."""
    off = region.storage_offset()
    half = heads * head_dim * n
    if region.numel() != 2 * half or not region.is_contiguous():
        raise ValueError(f"a chunk of {n} tokens needs {2 * half} contiguous elements")
    return (region.as_strided((heads, head_dim, n), (head_dim * n, n, 1), off),
            region.as_strided((heads, n, head_dim), (n * head_dim, head_dim, 1), off + half))


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

    `k_rows [H, D, n]` / `v_rows [H, n, D]` hold tokens [base, base + n). One strided copy each
    for K and V per run of whole consecutive blocks, and per partial block. Views are made by
    `as_strided` from the operands' own strides (any strided operand works): this runs per
    layer on P's forward path and D's load, where slicing and permuting cost more than the copy.
    """
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


def verify_paged_layout(kv_cache: torch.Tensor) -> None:
    """Check `paged_kv` against vLLM's CPU cache-write kernel on a scratch cache."""
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
    k_paged, v_paged = paged_kv(scratch)
    k_rows = torch.empty((h, d, n), dtype=kv_cache.dtype)
    v_rows = torch.empty((h, n, d), dtype=kv_cache.dtype)
    copy_tokens(k_paged, v_paged, [0, 1], k_rows, v_rows, bs, bs + n, bs, to_paged=False)
    k_ok = torch.equal(k_rows, key.permute(1, 2, 0))
    if not (k_ok and torch.equal(v_rows, value.permute(1, 0, 2))):
        raise RuntimeError(
            f"vLLM's CPU KV cache layout (ISA {isa!r}, dtype {kv_cache.dtype}) is not the one "
            "splitserve's connector reads; use --dtype float32 or the pinned vLLM release")
