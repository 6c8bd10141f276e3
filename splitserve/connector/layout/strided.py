"""vLLM's paged KV layouts for standard attention on CUDA, as device-agnostic torch.

vLLM 0.32 views every attention layer's cache as a logical `[B, H, N, C]` tensor: B blocks,
H KV heads, N token slots per block, C = K's `head_dim` elements followed by V's (the
FlashAttention, FlashInfer and Triton backends all split it as
`kv_cache.transpose(1, 2).split(head_dim, dim=-1)`). Where those axes sit in memory is the
engine's resolved `KVCacheLayout` (`vllm/v1/kv_cache_layout.py`): a stride order over the
five axes `[L, B, H, N, C]`, L being the layer, which `vllm/v1/kv_cache_interface.py`
`create_kv_cache_views` turns into per-layer strided views of one backing allocation.

| layout | per layer      | chosen by (vLLM 0.32, CUDA)                                          |
|--------|----------------|----------------------------------------------------------------------|
| LBNHC  | `[B, N, H, C]` | default ("NHD"): FlashAttention, Triton, FlashInfer before SM100     |
| LBHNC  | `[B, H, N, C]` | "HND": FlashInfer on SM100 (trtllm-gen), NIXL's preference           |
| BLHNC  | `[B, H, N, C]` | FlashInfer on SM100, block-outermost (all layers of a block adjacent)|
| BLNHC  | `[B, N, H, C]` | block-outermost NHD (allowed where no backend restricts layouts)     |
| BHLNC  | `[B, H, N, C]` | block, then head, then layer (likewise)                              |
| LHBNC  | `[H, B, N, C]` | head-outermost per layer (ROCm backends; likewise on CUDA)           |

`VLLM_KV_CACHE_LAYOUT` picks one of these explicitly ("NHD"/"HND" are aliases of LBNHC and
LBHNC). C is always innermost with stride 1. In the B-outermost layouts a layer's block stride
spans every layer's page, so a layer's view is not contiguous.

`StridedKV` copies a request's token range between one layer's view, whatever its strides,
and the staging format (`K [H, D, n]` then `V [H, n, D]`, token order = position order) with
a fixed number of kernels per call (one indexed gather or scatter of the tokens' slots, one
strided copy each for K and V), so a random block table costs no more than a contiguous one.
This module imports only torch: it is what `benchmarks/gpu_kv.py` runs on a machine without
vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: vLLM's `KVCacheLayout` members: name -> physical order of the logical axes [L, B, H, N, C]
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}

BlockIds = Sequence[int]


def layout_name(name: str) -> str:
    """The canonical layout name for `name` (aliases resolved); KeyError if unknown."""
    name = ALIASES.get(name, name)
    if name not in LAYOUTS:
        raise KeyError(f"unknown KV cache layout {name!r}; known: {', '.join(LAYOUTS)}")
    return name


def layer_view_order(name: str) -> tuple[int, ...]:
    """Physical order of one layer's logical axes [B, H, N, C] (vLLM's `layer_view_order`)."""
    return tuple(i - 1 for i in LAYOUTS[layout_name(name)] if i != 0)


def allocate_views(name: str, num_layers: int, num_blocks: int, num_kv_heads: int,
                   block_size: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per-layer `[B, H, N, 2*head_dim]` views of one zeroed allocation, strided as vLLM's
    `create_kv_cache_views` strides them for layout `name` (dense pages, no padding)."""
    order = LAYOUTS[layout_name(name)]
    shape = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=dtype, device=device)
    full = raw.as_strided(shape, tuple(strides))
    return [full[layer] for layer in range(num_layers)]


def matches(kv_cache: torch.Tensor, name: str) -> bool:
    """Whether a layer's `[B, H, N, C]` view is strided as layout `name` places it: C has
    stride 1, and each axis of size > 1 lies outside the next one of the layout's per-layer
    order without overlapping it (padding between blocks or layers is allowed)."""
    if kv_cache.dim() != 4 or kv_cache.stride(3) != 1:
        return False
    axes = [a for a in layer_view_order(name) if kv_cache.shape[a] > 1]
    return all(kv_cache.stride(outer) >= kv_cache.stride(inner) * kv_cache.shape[inner]
               for outer, inner in zip(axes, axes[1:], strict=False))


class StridedKV:
    """One layer of a vLLM standard-attention cache, `[B, H, N, 2*head_dim]` with any strides
    whose innermost axis is C (stride 1): token ranges to and from the staging format.

    Regions are 1-D contiguous uint8 tensors on the cache's device (`gather_device`,
    `scatter_device`) or on the host (`gather`, `scatter`, which go through a temporary device
    buffer and return when the copy is complete). The caller guarantees the engine is not
    writing the blocks concerned (P: the layer that wrote them has run; D: the request is not
    scheduled until its load is reported).
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or kv_cache.stride(3) != 1:
            raise ValueError(
                f"expected a [blocks, kv_heads, block_size, 2*head_dim] cache with a unit-stride "
                f"last axis, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
        self.cache = kv_cache
        self.num_blocks, self.num_kv_heads, self.block_size, c = kv_cache.shape
        self.head_dim = c // 2
        self.dtype = kv_cache.dtype
        self.device = kv_cache.device
        self.elem_bytes = kv_cache.element_size()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def holds(self, kv_layer: torch.Tensor) -> bool:
        """Whether `kv_layer` starts where this layer's cache does (vLLM may hand the layer a
        kernel-block view of the same memory, of another shape)."""
        return kv_layer.data_ptr() == self.cache.data_ptr()

    # -- the token slots -----------------------------------------------------------------------
    def slots(self, block_ids: BlockIds, start: int, end: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) of tokens [start, end), as int64 tensors on the cache's device. The
        block table goes over in one (pinned, asynchronous on CUDA) host-to-device copy;
        ValueError if it does not cover the range or names blocks the cache has not."""
        first, last = start // self.block_size, -(-end // self.block_size)
        ids = list(block_ids[first:last])
        # checked here, on the host: an out-of-range index on a GPU is a device-side assert
        # that poisons the whole CUDA context, not an exception for one transfer
        if not 0 <= start < end or len(ids) != last - first:
            raise ValueError(f"a block table of {len(block_ids)} blocks of {self.block_size} "
                             f"does not cover tokens [{start}, {end})")
        if min(ids) < 0 or max(ids) >= self.num_blocks:
            raise ValueError(f"block ids outside [0, {self.num_blocks})")
        table = torch.tensor(ids, dtype=torch.int64)
        if self.device.type != "cpu":
            table = table.pin_memory().to(self.device, non_blocking=True)
        pos = torch.arange(start - first * self.block_size, end - first * self.block_size,
                           device=self.device)
        return table[pos // self.block_size], pos % self.block_size

    def _views(self, region: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, d = self.num_kv_heads, self.head_dim
        if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
            raise ValueError("a staging region is a 1-D contiguous uint8 tensor")
        if region.numel() != n * self.bytes_per_token:
            raise ValueError(f"{n} tokens need {n * self.bytes_per_token} staging bytes, "
                             f"the region has {region.numel()}")
        elems = region.view(self.dtype)
        half = h * d * n
        return elems[:half].view(h, d, n), elems[half:].view(h, n, d)

    # -- device-side copies (the asynchronous path queues these on a side stream) ------------
    def gather_device(self, block_ids: BlockIds, start: int, end: int,
                      region: torch.Tensor) -> None:
        """Tokens [start, end) into `region` (on the cache's device, staging format)."""
        n = end - start
        k_rows, v_rows = self._views(region, n)
        blk, slot = self.slots(block_ids, start, end)
        rows = self.cache[blk, :, slot]  # [n, H, C]: one gather of n slots
        d = self.head_dim
        k_rows.copy_(rows[..., :d].permute(1, 2, 0))
        v_rows.copy_(rows[..., d:].permute(1, 0, 2))

    def scatter_device(self, block_ids: BlockIds, start: int, end: int,
                       region: torch.Tensor, region_start: int) -> None:
        """Tokens [start, end) from `region` (on the cache's device; it holds tokens
        [region_start, end)) into the blocks."""
        n = end - region_start
        k_rows, v_rows = self._views(region, n)
        skip = start - region_start
        rows = torch.empty((end - start, self.num_kv_heads, 2 * self.head_dim),
                           dtype=self.dtype, device=self.device)
        d = self.head_dim
        rows[..., :d].copy_(k_rows[:, :, skip:].permute(2, 0, 1))
        rows[..., d:].copy_(v_rows[:, skip:].permute(1, 0, 2))
        blk, slot = self.slots(block_ids, start, end)
        self.cache[blk, :, slot] = rows  # one indexed scatter of n slots

    # -- host-side copies (synchronous) -------------------------------------------------------
    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor) -> None:
        """Tokens [start, end) into `region` (host or device); returns once it holds them."""
        if region.device == self.device:
            self.gather_device(block_ids, start, end, region)
            return
        tmp = torch.empty(region.numel(), dtype=torch.uint8, device=self.device)
        self.gather_device(block_ids, start, end, tmp)
        region.copy_(tmp)

    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None:
        """Tokens [start, end) from `region` (host or device); returns once the blocks hold
        them and the region may be reused."""
        if region.device == self.device:
            self.scatter_device(block_ids, start, end, region, region_start)
            return
        self.scatter_device(block_ids, start, end, region.to(self.device), region_start)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


#: the engine's cache-write op, as vLLM's backends call it:
#: write(key [n, H, D], value [n, H, D], k_cache [B, N, H, D], v_cache [B, N, H, D], slots [n])
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      None]


def verify_write_path(name: str, like: torch.Tensor, write: CacheWrite) -> str | None:
    """Write known K and V through the engine's own cache-write op into a scratch cache of
    layout `name` shaped like `like` (two layers, two blocks, tokens across the block
    boundary), read them back with `StridedKV.gather`; the mismatch found, or None."""
    _, heads, bs, c = like.shape
    d = c // 2
    scratch = allocate_views(name, 2, 2, heads, bs, d, like.dtype, like.device)[1]
    n = min(bs + 2, 2 * bs)
    start = 2 * bs - n
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((n, heads, d), generator=gen).to(like.dtype).to(like.device)
    value = torch.randn((n, heads, d), generator=gen).to(like.dtype).to(like.device)
    k_cache, v_cache = scratch.transpose(1, 2).split(d, dim=-1)
    write(key, value, k_cache, v_cache, torch.arange(start, 2 * bs, device=like.device))
    layer = StridedKV(scratch)
    region = torch.empty(n * layer.bytes_per_token, dtype=torch.uint8, device=like.device)
    layer.gather_device([0, 1], start, 2 * bs, region)
    k_rows, v_rows = layer._views(region, n)
    if not torch.equal(k_rows, key.permute(1, 2, 0)):
        return "K is not where the engine's cache write puts it"
    if not torch.equal(v_rows, value.permute(1, 0, 2)):
        return "V is not where the engine's cache write puts it"
    return None
