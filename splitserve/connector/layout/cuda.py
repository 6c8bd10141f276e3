"""vLLM's paged layouts for standard attention on CUDA (FlashAttention, FlashInfer, Triton).

Each layer is vLLM's `[B, H, N, 2*head_dim]` view (K then V along the last axis) in the
engine's resolved `KVCacheLayout`: LBNHC (vLLM's default, "NHD"), LBHNC ("HND"), BLHNC,
BLNHC, BHLNC or LHBNC (see `strided`, which does the copies). Chosen when the engine says its
caches are CUDA tensors of standard attention in one of those layouts and each view's strides
agree with it; `verify` writes known K and V through vLLM's own `reshape_and_cache_flash`
(the cache write of all three backends) into a scratch cache of that layout and reads them
back. Latent (MLA), mamba and quantized (fp8, uint8-stored) caches are not read.

`gather_device`/`scatter_device` are the device-side halves the connector's side-stream
copier (`devcopy.CudaCopies`, measured by `benchmarks/gpu_kv.py`) queues for P's saves and D's
loads. `gather`/`scatter` are synchronous and go through a temporary device buffer: P's sender
thread uses them for a layer the copier had no room for. Host buffers are pinned.
"""

from __future__ import annotations

import torch

from splitserve.connector.layout.paged import EngineKV, PagedLayout, UnsupportedKVCache
from splitserve.connector.layout.staging_format import BlockIds
from splitserve.connector.layout.strided import (
    LAYOUTS,
    StridedKV,
    layout_name,
    matches,
    verify_write_path,
)

#: vLLM attention backends whose caches are the standard `[B, H, N, 2*head_dim]` views
BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class VllmCudaLayout(PagedLayout):
    """One layer of a vLLM CUDA standard-attention cache (see the module docstring)."""

    name = "vLLM-CUDA"

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._kv = StridedKV(kv_cache)

    @classmethod
    def reason(cls, kv_cache: torch.Tensor, engine: EngineKV, device_type: str | None = None
               ) -> str | None:
        """Why this implementation does not read `kv_cache` (None: it does). `device_type`
        stands for the tensor's own device type (tests pass CPU tensors strided as CUDA's)."""
        device_type = device_type or kv_cache.device.type
        if engine.device != "cuda" or device_type != "cuda":
            return "not a CUDA cache"
        if engine.latent:
            return "a latent (MLA) cache"
        if any("Mamba" in k for k in engine.spec_kinds):
            return "a mamba state cache"
        if not engine.backends or any(b not in BACKENDS for b in engine.backends):
            return f"attention backend {'/'.join(engine.backends) or 'unknown'}"
        try:
            layout = layout_name(engine.cache_layout or "")
        except KeyError:
            return f"cache layout {engine.cache_layout}"
        if kv_cache.dtype not in DTYPES:
            return f"a {str(kv_cache.dtype).replace('torch.', '')} (quantized) cache"
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
            return "not a [num_blocks, kv_heads, block_size, 2*head_dim] view"
        if not matches(kv_cache, layout):
            return f"strides {tuple(kv_cache.stride())} are not layout {layout}'s"
        return None

    @classmethod
    def recognises(cls, kv_cache: torch.Tensor, engine: EngineKV) -> bool:
        return cls.reason(kv_cache, engine) is None

    @classmethod
    def expects(cls) -> str:
        return (f"{cls.name}: one CUDA [num_blocks, kv_heads, block_size, 2*head_dim] view per "
                f"layer (K then V; float16/bfloat16/float32), attention backend "
                f"{'/'.join(BACKENDS)}, layout {'/'.join(LAYOUTS)}")

    @classmethod
    def verify(cls, kv_cache: torch.Tensor, engine: EngineKV) -> None:
        from vllm import _custom_ops as ops

        one = torch.ones((), dtype=torch.float32, device=kv_cache.device)

        def write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> None:
            ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, "auto", one, one)

        layout = layout_name(engine.cache_layout or "")
        problem = verify_write_path(layout, kv_cache, write)
        if problem is not None:
            raise UnsupportedKVCache(
                f"vLLM's CUDA KV cache (layout {layout}, dtype {kv_cache.dtype}): {problem}; "
                "splitserve's connector does not read this vLLM release's cache")

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def num_kv_heads(self) -> int:
        return self._kv.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._kv.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._kv.dtype

    def holds(self, kv_layer: torch.Tensor) -> bool:
        return self._kv.holds(kv_layer)

    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor) -> None:
        self._kv.gather(block_ids, start, end, region)

    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None:
        self._kv.scatter(block_ids, start, end, region, region_start)

    def gather_device(self, block_ids: BlockIds, start: int, end: int,
                      region: torch.Tensor) -> None:
        self._kv.gather_device(block_ids, start, end, region)

    def scatter_device(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                       region_start: int) -> None:
        self._kv.scatter_device(block_ids, start, end, region, region_start)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._kv.device.type != "cuda":
            return super().host_buffer(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
