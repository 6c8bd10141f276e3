"""KV layouts: vLLM's paged CPU cache on one side, splitserve's staging layout on the other.

Paged (vLLM CPU attention): one tensor per layer, `[num_blocks, kv_heads, block_size, 2*head_dim]`,
viewed as `[num_blocks, kv_heads, 2, block_size, head_dim]`: within a block and head, K for the
block's tokens comes first, then V (K and V split along the token axis).

Staging (per transfer): layer-major; within a layer `[2, kv_heads, num_tokens, head_dim]`. Each
(K/V, head) row is token-contiguous, so P and D need not share a block size, and a block's run of
tokens is one contiguous piece on both sides (no gather copy before sending).
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


def paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """`[num_blocks, H, block_size, 2*D]` -> `[num_blocks, H, 2, block_size, D]` (a view)."""
    nb, h, bs, d2 = kv_cache.shape
    if not kv_cache.is_contiguous() or d2 % 2:
        raise ValueError(f"unexpected paged KV layout {tuple(kv_cache.shape)}")
    return kv_cache.view(nb, h, 2, bs, d2 // 2)


def block_runs(block_ids: list[int], block_size: int, start: int, end: int
               ) -> list[tuple[int, int, int, int]]:
    """Split tokens [start, end) by block: (block_id, offset_in_block, token, count)."""
    runs = []
    t = start
    while t < end:
        bi, off = divmod(t, block_size)
        n = min(block_size - off, end - t)
        runs.append((block_ids[bi], off, t, n))
        t += n
    return runs


def source_pieces(paged: torch.Tensor, block_ids: tuple[int, ...] | list[int], start: int,
                  end: int) -> list[list[memoryview]]:
    """Byte views of paged memory for tokens [start, end) of one layer, grouped by staging row.

    `groups[kv * H + h]` lists the block runs of row (kv, h); concatenated they are exactly that
    row's staging bytes for the token range. No data is copied.
    """
    _, heads, _, block_size, _ = paged.shape
    flat = paged.view(torch.uint8)
    runs = block_runs(list(block_ids), block_size, start, end)
    return [
        [memoryview(flat[block, h, kv, off:off + n].numpy()).cast("B") for block, off, _, n in runs]
        for kv in range(2) for h in range(heads)
    ]


def staging_rows(layer_region: torch.Tensor, heads: int, num_tokens: int) -> torch.Tensor:
    """A layer's staging bytes as `[2, H, num_tokens, D]` of the KV dtype."""
    return layer_region.view(2, heads, num_tokens, -1)


def scatter_into_paged(paged: torch.Tensor, rows: torch.Tensor, block_ids: list[int],
                       start: int, end: int) -> None:
    """Copy staged rows for tokens [start, end) into D's blocks (one layer).

    `start` is block-aligned on D (local prefix hits are whole blocks), so whole blocks go in one
    `index_copy_`, and only a trailing partial block is copied on its own.
    """
    block_size = paged.shape[3]
    if start % block_size:
        raise ValueError("load start must be block-aligned")
    first = start // block_size
    n_full = (end - start) // block_size
    if n_full:
        src = rows[:, :, start:start + n_full * block_size, :]
        src = src.reshape(2, rows.shape[1], n_full, block_size, rows.shape[3]).permute(2, 1, 0, 3, 4)
        idx = torch.tensor(block_ids[first:first + n_full], dtype=torch.long)
        paged.index_copy_(0, idx, src)
    tail_start = start + n_full * block_size
    if tail_start < end:
        n = end - tail_start
        block = block_ids[tail_start // block_size]
        paged[block, :, :, :n, :] = rows[:, :, tail_start:end, :].permute(1, 0, 2, 3)
