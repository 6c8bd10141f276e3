"""The `PagedLayout` interface: one layer of the engine's paged KV cache, as the connector
reads it on P and writes it on D. Implementations live beside this module (`cpu.py`), and
`select.py` picks one from the engine's caches and `EngineKV` at start-up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from splitserve.connector.layout.staging_format import BlockIds, KVShape


@dataclass(frozen=True)
class EngineKV:
    """What the engine says about its KV cache, read once at start-up.

    `device`: the caches' device type ("cpu", "cuda"); `backends`: the attention backends'
    names as vLLM reports them (e.g. "CPU_ATTN", "FLASH_ATTN"), empty when unknown;
    `cache_layout`: vLLM's resolved `KVCacheLayout` name (e.g. "LBHNC"), None when unknown;
    `use_mla`: the model uses a latent (MLA) cache; `spec_kinds`: the class names of the KV
    cache groups' specs (e.g. "FullAttentionSpec", "MambaSpec"); `kv_cache_groups`: how many
    groups vLLM split the layers into (each with its own block table per request).
    """

    device: str
    backends: tuple[str, ...] = ()
    cache_layout: str | None = None
    use_mla: bool = False
    spec_kinds: tuple[str, ...] = ()
    kv_cache_groups: int = 1

    @property
    def latent(self) -> bool:
        """A latent (MLA) cache, by the model's flag or a KV spec's kind."""
        return self.use_mla or any("MLA" in k for k in self.spec_kinds)

    def describe(self) -> str:
        parts = [f"device {self.device}"]
        if self.backends:
            parts.append(f"attention backend {'/'.join(self.backends)}")
        if self.cache_layout:
            parts.append(f"cache layout {self.cache_layout}")
        if self.use_mla:
            parts.append("latent (MLA) cache")
        if self.spec_kinds:
            parts.append(f"KV specs {'/'.join(self.spec_kinds)}")
        if self.kv_cache_groups > 1:
            parts.append(f"{self.kv_cache_groups} KV cache groups")
        return ", ".join(parts)


class UnsupportedKVCache(RuntimeError):
    """The engine's KV cache is in a layout no `PagedLayout` implementation reads; raised at
    start-up (registration), before any request is served."""


class PagedLayout(ABC):
    """One layer of the engine's paged KV cache: where each token's K and V live.

    Logical model: the layer holds `num_blocks` blocks of `block_size` token slots. Token t of
    a request whose block table is `block_ids` lives in block `block_ids[t // block_size]`,
    slot `t % block_size`; each slot holds K and V for `num_kv_heads` heads of `head_dim`
    elements of `dtype`. How those elements sit in memory (which axis is outermost, whether K
    is token- or dimension-major, device) is the implementation's business.

    Staging format (the other side of every copy; see `staging_format`): a region for tokens
    [s, e), n = e - s, is a 1-D, contiguous, host (CPU) uint8 tensor of exactly
    `n * bytes_per_token` bytes, read as `dtype` elements: K `[H, D, n]` (dimension-major),
    then V `[H, n, D]` (token-major), token order = position order. The format is the same for
    every implementation, so P and D may differ in block size, layout and device; no dtype
    conversion happens (both sides' caches have the model's KV dtype, checked by the handshake
    fingerprint).

    Ownership: the layout holds views of the engine's cache tensor, which the engine owns and
    neither frees nor moves while it runs (`holds` lets the caller check that it did not).
    Regions belong to the caller (D's staging segment, a transport's send buffer, from
    `host_buffer`); the layout neither keeps references to them nor allocates per call.

    Synchrony and threads: `gather` returns when the region holds the bytes; `scatter` returns
    when the blocks hold them and the region may be reused. Instances are immutable after
    construction; `gather`/`scatter` may run concurrently on several threads (P's forward
    thread and a sender thread) as long as their regions differ. The caller guarantees that
    the engine is not writing the blocks concerned: on P they were written by the layer that
    just ran and stay held until the transfer settles; on D they are allocated to a request
    that is not scheduled until its load is reported.
    """

    #: the name used in logs and refusal messages, e.g. "vLLM-CPU"
    name: ClassVar[str]
    #: a latent cache (MLA): each slot holds one vector of `head_dim` elements (num_kv_heads
    #: 1), staged as `[n, head_dim]` rows, not a K and a V
    latent: ClassVar[bool] = False

    @abstractmethod
    def __init__(self, kv_cache: torch.Tensor) -> None:
        """Read one layer's cache tensor, as the engine registered it (`recognises` said yes)."""

    @classmethod
    @abstractmethod
    def recognises(cls, kv_cache: torch.Tensor, engine: EngineKV) -> bool:
        """Whether this implementation reads a cache of this shape, strides, dtype and device
        from an engine with these facts. Must not raise, nor touch the tensor's data."""

    @classmethod
    @abstractmethod
    def expects(cls) -> str:
        """One line naming what this implementation reads, for refusal messages."""

    @classmethod
    @abstractmethod
    def verify(cls, kv_cache: torch.Tensor, engine: EngineKV) -> None:
        """At start-up, on scratch memory shaped like `kv_cache`: check that the engine's own
        cache-write path puts K and V where `gather` reads them; raise `UnsupportedKVCache`
        with the reason if not. Called once per engine, before any request."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Token slots per block."""

    @property
    @abstractmethod
    def num_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    def bytes_per_token(self) -> int:
        """Staging bytes of one token of this layer (K and V of every head, or the latent)."""
        parts = 1 if self.latent else 2
        return parts * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @abstractmethod
    def holds(self, kv_layer: torch.Tensor) -> bool:
        """Whether `kv_layer` (what the engine hands `save_kv_layer`) is the memory this layout
        was built on."""

    @abstractmethod
    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor) -> None:
        """Copy tokens [start, end) of the request with block table `block_ids` out of the
        blocks into `region` (the staging format, exactly (end - start) tokens)."""

    @abstractmethod
    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None:
        """Copy tokens [start, end) from `region` into the blocks of block table `block_ids`.
        `region` holds tokens [region_start, end) in the staging format,
        region_start <= start (the tokens before `start` are skipped: D already has them)."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of `nbytes` for regions of this layout (a transport's send
        buffer): plain memory here; a device layout returns memory its copies are fast from
        (e.g. pinned)."""
        return torch.empty(nbytes, dtype=torch.uint8)


def kv_shape(layouts: list[PagedLayout]) -> KVShape:
    """The staging shape of an engine's layers (every layer has the same heads and dtype)."""
    first = layouts[0]
    return KVShape(len(layouts), first.num_kv_heads, first.head_dim, first.dtype, first.latent)
