"""`HeadSlice`: some of a layer's KV heads, as a `PagedLayout` of its own.

A piece of a transfer between tensor-parallel ranks (`connector.ranks`) holds the heads
[lo, hi) of the rank's cache, in the staging format of those heads alone. `HeadSlice` reads
and writes such a piece through the layer's own layout: `gather` gathers every head into a
scratch region and keeps the piece's two runs (K's and V's heads are contiguous in the staging
format); `scatter` gathers the rank's current tokens, overwrites the piece's heads and scatters
the result back, so the other heads' bytes are written back unchanged. Both are synchronous
host copies (twice the bytes of the inner layout's), and the caller must not run two
`scatter`s of the same blocks at once. A latent cache is never sliced (it has one head).
"""

from __future__ import annotations

import torch

from splitserve.connector.layout.paged import EngineKV, PagedLayout
from splitserve.connector.layout.staging_format import BlockIds, chunk_views


class HeadSlice(PagedLayout):
    name = "head slice"

    def __init__(self, inner: PagedLayout, lo: int = 0, hi: int = 0) -> None:
        if inner.latent or not 0 <= lo < hi <= inner.num_kv_heads:
            raise ValueError(f"heads [{lo}, {hi}) are not a part of {inner.num_kv_heads} K/V heads")
        self.inner, self.lo, self.hi = inner, lo, hi

    @classmethod
    def recognises(cls, kv_cache: torch.Tensor, engine: EngineKV) -> bool:
        return False  # built over another layout, never chosen for an engine's cache

    @classmethod
    def expects(cls) -> str:
        return "a range of the heads of another layout"

    @classmethod
    def verify(cls, kv_cache: torch.Tensor, engine: EngineKV) -> None:
        return None  # the inner layout was verified

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.hi - self.lo

    @property
    def head_dim(self) -> int:
        return self.inner.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def holds(self, kv_layer: torch.Tensor) -> bool:
        return self.inner.holds(kv_layer)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self.inner.host_buffer(nbytes)

    def _views(self, region: torch.Tensor, heads: int, n: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_views(region.view(self.dtype), heads, self.head_dim, n)

    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor) -> None:
        n = end - start
        full = torch.empty(n * self.inner.bytes_per_token, dtype=torch.uint8)
        self.inner.gather(block_ids, start, end, full)
        k_all, v_all = self._views(full, self.inner.num_kv_heads, n)
        k, v = self._views(region, self.num_kv_heads, n)
        k.copy_(k_all[self.lo:self.hi])
        v.copy_(v_all[self.lo:self.hi])

    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None:
        n, skip = end - start, start - region_start
        full = torch.empty(n * self.inner.bytes_per_token, dtype=torch.uint8)
        self.inner.gather(block_ids, start, end, full)
        k_all, v_all = self._views(full, self.inner.num_kv_heads, n)
        k, v = self._views(region, self.num_kv_heads, end - region_start)
        k_all[self.lo:self.hi].copy_(k[:, :, skip:])
        v_all[self.lo:self.hi].copy_(v[:, skip:, :])
        self.inner.scatter(block_ids, start, end, full, start)
