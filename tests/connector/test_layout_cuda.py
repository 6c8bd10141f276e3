"""vLLM's CUDA layouts behind `PagedLayout`, on CPU tensors strided as vLLM strides CUDA caches:
recognised from the engine's facts (device, backend, resolved layout, strides, dtype), and
latent (MLA) and mamba caches refused by name at start-up."""

from __future__ import annotations

import pytest
import torch

from splitserve.connector.layout.cuda import VllmCudaLayout
from splitserve.connector.layout.paged import EngineKV, UnsupportedKVCache
from splitserve.connector.layout.select import select_layouts
from splitserve.connector.layout.strided import LAYOUTS, allocate_views, layer_view_order


def _engine(layout: str, **kw: object) -> EngineKV:
    base = {"device": "cuda", "backends": ("FLASH_ATTN",), "cache_layout": layout,
            "spec_kinds": ("FullAttentionSpec",)}
    return EngineKV(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_layouts_are_recognised_from_the_engine_facts(name: str) -> None:
    cache = allocate_views(name, 2, 4, 2, 16, 8, torch.bfloat16)[1]
    for backend in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        assert VllmCudaLayout.reason(cache, _engine(name, backends=(backend,)), "cuda") is None
    other = next(o for o in LAYOUTS if layer_view_order(o) != layer_view_order(name))
    assert "strides" in str(VllmCudaLayout.reason(cache, _engine(other), "cuda"))
    assert "FLEX" in str(VllmCudaLayout.reason(cache, _engine(name, backends=("FLEX",)), "cuda"))
    fp8 = cache.view(torch.uint8)[..., :16]
    assert "quantized" in str(VllmCudaLayout.reason(fp8, _engine(name), "cuda"))
    assert not VllmCudaLayout.recognises(cache, _engine(name))  # a CPU tensor is not CUDA's


def _refusal(caches: list[tuple[str, torch.Tensor]], engine: EngineKV) -> str:
    with pytest.raises(UnsupportedKVCache) as err:
        select_layouts(caches, engine)
    return str(err.value)


def test_latent_and_mamba_caches_are_refused_by_name_on_gpu() -> None:
    """vLLM 0.32's MLA view is [B, 1, N, kv_lora_rank + rope_dim] (576 for DeepSeek): even
    in size, so only the engine's facts tell it from K and V; mamba state is raw bytes."""
    mla = allocate_views("LBNHC", 2, 8, 1, 16, 288, torch.bfloat16)
    msg = _refusal([(f"layers.{i}.attn", c) for i, c in enumerate(mla)],
                   _engine("LBNHC", use_mla=True, spec_kinds=("MLAAttentionSpec",)))
    assert "latent (MLA)" in msg and "MLAAttentionSpec" in msg and "(8, 1, 16, 576)" in msg
    mixed = [("layers.0.attn", allocate_views("LBNHC", 1, 8, 2, 16, 8, torch.bfloat16)[0]),
             ("layers.1.mixer", torch.zeros(8, 1, 1, 4096, dtype=torch.int8))]
    msg = _refusal(mixed, _engine("LBNHC", spec_kinds=("FullAttentionSpec", "MambaSpec")))
    assert "mamba state cache" in msg and "MambaSpec" in msg and "vLLM-CUDA" in msg
