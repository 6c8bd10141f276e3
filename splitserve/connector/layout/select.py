"""Choosing the `PagedLayout` for an engine's KV caches at start-up, or refusing them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.layout.cpu_mla import VllmCpuMlaLayout
from splitserve.connector.layout.cuda import VllmCudaLayout
from splitserve.connector.layout.paged import EngineKV, PagedLayout, UnsupportedKVCache

#: implementations tried in order; the first that recognises every layer's cache is used
LAYOUTS: tuple[type[PagedLayout], ...] = (VllmCpuLayout, VllmCpuMlaLayout, VllmCudaLayout)

#: what to use where no implementation reads the cache
ALTERNATIVE = ("Run the worker on vLLM-CPU or a standard-attention model, or for PD "
               "disaggregation of this model use vLLM's NixlConnector")


def refused_kind(engine: EngineKV) -> str | None:
    """The kind of KV cache no implementation reads, whatever its tensors look like."""
    if engine.latent and engine.device != "cpu":
        return (f"a latent (MLA) KV cache on {engine.device} (MLAAttentionSpec: one "
                "compressed latent row per token, no per-head K and V; it reads the latent on "
                "vLLM-CPU's MLA backend only)")
    if any("Mamba" in k for k in engine.spec_kinds):
        return ("a hybrid model's mamba state cache (MambaSpec: one recurrent state per "
                "request, not K and V per token)")
    if engine.kv_cache_groups > 1:
        return (f"a KV cache in {engine.kv_cache_groups} groups (e.g. sliding-window and "
                "full-attention layers, each group with its own block table per request; the "
                "connector moves one block table per request: leave vLLM's hybrid KV cache "
                "manager off, as it is by default with a KV connector, i.e. drop "
                "--no-disable-hybrid-kv-cache-manager)")
    return None


def _describe(name: str, cache: torch.Tensor) -> str:
    return (f"layer {name!r}: {cache.device.type} tensor of shape {tuple(cache.shape)}, "
            f"strides {tuple(cache.stride())}, dtype {str(cache.dtype).replace('torch.', '')}")


def select_layouts(caches: Sequence[tuple[str, torch.Tensor]], engine: EngineKV,
                   layouts: Sequence[type[PagedLayout]] = LAYOUTS) -> list[PagedLayout]:
    """One `PagedLayout` per layer (in the order given), of the first implementation that
    recognises every layer's cache, verified against the engine once.

    Raises `UnsupportedKVCache` naming the first unrecognised cache's shape, the engine's
    facts, what each implementation reads, and the alternative.
    """
    if not caches:
        raise UnsupportedKVCache("the engine registered no KV cache layers")
    supported = "; ".join(cls.expects() for cls in layouts)
    if (kind := refused_kind(engine)) is not None:
        raise UnsupportedKVCache(
            f"splitserve's connector does not read {kind} ({_describe(*caches[0])}; "
            f"{engine.describe()}). It reads {supported}. {ALTERNATIVE}.")
    for cls in layouts:
        if all(cls.recognises(cache, engine) for _, cache in caches):
            cls.verify(caches[0][1], engine)
            return [cls(cache) for _, cache in caches]
    odd = next(((n, c) for n, c in caches
                if not any(cls.recognises(c, engine) for cls in layouts)), caches[0])
    raise UnsupportedKVCache(
        f"splitserve's connector cannot read this engine's KV cache ({_describe(*odd)}; "
        f"{engine.describe()}). It reads {supported}. {ALTERNATIVE}.")
