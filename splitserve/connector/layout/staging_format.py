"""The staging format: how one transfer's KV bytes are laid out in flight and in D's staging.

A transfer of the prompt tokens [first, num_tokens) is chunk-major, then layer-major (`first`
> 0: D's prefix cache already holds tokens [0, first), so P sends only the rest). A chunk is the
token range one prefill step computed, less the skipped prefix; chunks partition
[first, num_tokens) in order and every layer sees the same chunks. The region of (layer,
chunk [s, e)), n = e - s tokens, holds 2 * H * D * n elements of the KV dtype, contiguous:

- K as `[H, D, n]` (dimension-major: element (h, d, t) at `(h * D + d) * n + t`), then
- V as `[H, n, D]` (token-major: element (h, t, d) at `H * D * n + (h * n + t) * D + d`),

where t counts from s. A latent cache (MLA: one vector of D elements per token and layer, no K
and V; `KVShape.latent`, H = 1) has one part instead: `[n, D]`, token-major, D * n elements.
Rows are token-contiguous, so P and D need not share a block size, a paged layout or a device.
`region_offset` gives where (layer, chunk) starts, and `transfer_bytes(num_tokens - first)`
the size of the whole region.
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
    latent: bool = False  # one latent vector a token (num_kv_heads 1), not a K and a V

    @property
    def elem_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token_layer(self) -> int:
        return (1 if self.latent else 2) * self.num_kv_heads * self.head_dim * self.elem_bytes

    def layer_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token_layer

    def transfer_bytes(self, num_tokens: int) -> int:
        return self.num_layers * self.layer_bytes(num_tokens)


BlockIds = list[int] | tuple[int, ...]


def region_offset(shape: KVShape, start: int, end: int, layer: int, first: int = 0) -> int:
    """Byte offset of (layer, chunk [start, end)) in the staging region of a transfer whose
    first token is `first` (the tokens before it are not sent).

    Valid because chunks partition [first, num_tokens) in order and every layer sees the same
    chunks.
    """
    if start < first:
        raise ValueError(f"chunk [{start}, {end}) starts before the transfer's token {first}")
    return ((start - first) * shape.num_layers + layer * (end - start)
            ) * shape.bytes_per_token_layer


def chunk_views(region: torch.Tensor, heads: int, head_dim: int, n: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A (layer, chunk) staging region (1-D, the KV dtype) as K `[H, D, n]` and V `[H, n, D]`."""
    off = region.storage_offset()
    half = heads * head_dim * n
    if region.numel() != 2 * half or not region.is_contiguous():
        raise ValueError(f"a chunk of {n} tokens needs {2 * half} contiguous elements")
    return (region.as_strided((heads, head_dim, n), (head_dim * n, n, 1), off),
            region.as_strided((heads, n, head_dim), (n * head_dim, head_dim, 1), off + half))
