"""What a Hugging Face `config.json` says about a decoder's KV cache and its experts, read once
for every part that sizes KV or weights (the router's transfer estimate, the launcher's fit
check, the simulator's measured and analytic profiles).

Contracts:
- `kv_shape` describes the KV one token leaves in each layer as vLLM allocates it by default:
  K and V of `kv_heads` heads of `head_dim` each; or, for multi-head latent attention (MLA:
  DeepSeek-V2/V3, Kimi-K2; the config has `kv_lora_rank`), one latent vector of
  `kv_lora_rank + qk_rope_head_dim` elements (`latent`), the same on every TP rank.
- `moe_shape` is None for a dense model. For a mixture of experts it counts what each layer
  holds (`experts` routed experts, optional shared experts) and what a token computes
  (`experts_per_token` routed experts plus the shared ones); `dense_layers` keep a plain MLP of
  the config's `intermediate_size`.
- Both raise KeyError, TypeError or ValueError on a config they cannot read; callers that can
  do without the figure catch them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class KvShape:
    layers: int
    kv_heads: int  # 1 for a latent
    head_dim: int  # a latent's width for MLA
    latent: bool = False

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"a KV shape needs positive sizes, got {self}")

    @property
    def elements_per_token(self) -> int:
        """KV elements one token holds over all layers (K and V, or the one latent)."""
        return (1 if self.latent else 2) * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class MoeShape:
    experts: int  # routed experts in each MoE layer
    experts_per_token: int
    expert_intermediate: int
    shared_intermediate: int  # all shared experts of a layer together; 0 when none
    moe_layers: int
    dense_layers: int  # layers with a plain MLP of the config's intermediate_size

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.experts or self.expert_intermediate < 1:
            raise ValueError(f"an MoE shape needs 1 <= experts_per_token <= experts, got {self}")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`config.json` of a model directory (or the path of a config file itself)."""
    p = Path(model_dir)
    cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: config.json is not an object")
    return cfg


def kv_shape(cfg: dict[str, Any]) -> KvShape:
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):
        return KvShape(layers, 1, int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]),
                       latent=True)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return KvShape(layers, int(cfg.get("num_key_value_heads") or heads), head_dim)


def moe_shape(cfg: dict[str, Any]) -> MoeShape | None:
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts")
                  or cfg.get("n_routed_experts") or 0)
    if experts == 0:
        return None
    if not cfg.get("num_experts_per_tok"):
        raise ValueError(f"the config has {experts} experts but no num_experts_per_tok")
    layers = int(cfg["num_hidden_layers"])
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)  # Qwen-MoE: layer i is MoE if (i+1) % step == 0
    first_dense = int(cfg.get("first_k_dense_replace") or 0)  # DeepSeek: the first k are dense,
    freq = int(cfg.get("moe_layer_freq") or 1)  # then every freq-th layer is MoE
    dense |= {i for i in range(layers) if i < first_dense or (i + 1) % step or i % freq}
    expert = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size")
                 or expert * int(cfg.get("n_shared_experts") or 0))
    return MoeShape(experts, int(cfg["num_experts_per_tok"]), expert, shared,
                    layers - len(dense), len(dense))
