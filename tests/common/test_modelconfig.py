"""KV and expert shapes read from public configs, and the analytic profiles built on them:
parameter counts against the published totals, MLA's latent KV, dense models unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from splitserve.common.modelconfig import KvShape, MoeShape, kv_shape, moe_shape
from splitserve.router.prompt import kv_bytes_per_token
from splitserve.sim.analytic import PRESETS, ModelConfig, analytic_profile
from splitserve.sim.model import Profile

# the public configs' fields that matter here
LLAMA_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
MIXTRAL_8X7B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2}
QWEN3_30B_A3B = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "vocab_size": 129280}


def config_dir(tmp_path: Path, cfg: dict[str, Any], name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_kv_shapes() -> None:
    assert kv_shape(LLAMA_8B) == KvShape(32, 8, 128)
    assert kv_shape(LLAMA_8B).elements_per_token == 2 * 32 * 8 * 128
    assert kv_shape(QWEN3_30B_A3B) == KvShape(48, 4, 128)
    latent = kv_shape(DEEPSEEK_V3)  # one latent of 512 + 64 a layer, no K/V pair
    assert latent == KvShape(61, 1, 576, latent=True) and latent.elements_per_token == 61 * 576
    with pytest.raises(KeyError):
        kv_shape({"hidden_size": 8})


def test_moe_shapes() -> None:
    assert moe_shape(LLAMA_8B) is None
    assert moe_shape(MIXTRAL_8X7B) == MoeShape(8, 2, 14336, 0, 32, 0)
    assert moe_shape(QWEN3_30B_A3B) == MoeShape(128, 8, 768, 0, 48, 0)
    assert moe_shape(DEEPSEEK_V3) == MoeShape(256, 8, 2048, 2048, 58, 3)
    sparse_every_2nd = QWEN3_30B_A3B | {"decoder_sparse_step": 2, "mlp_only_layers": [1]}
    assert moe_shape(sparse_every_2nd).moe_layers == 23  # odd layers, less layer 1
    every_2nd_after_3 = DEEPSEEK_V3 | {"moe_layer_freq": 2}  # layers 4, 6, ..., 60
    assert moe_shape(every_2nd_after_3).moe_layers == 29
    with pytest.raises(ValueError, match="experts_per_token"):
        moe_shape(MIXTRAL_8X7B | {"num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="no num_experts_per_tok"):
        moe_shape({k: v for k, v in MIXTRAL_8X7B.items() if k != "num_experts_per_tok"})


@pytest.mark.parametrize(("cfg", "total", "active"), [
    (LLAMA_8B, 8.03e9, 8.03e9),
    (MIXTRAL_8X7B, 46.7e9, 12.9e9),
    (QWEN3_30B_A3B, 30.5e9, 3.3e9),
    (DEEPSEEK_V3, 671e9, 37e9),
])
def test_parameter_counts_match_the_published_totals(tmp_path: Path, cfg: dict[str, Any],
                                                     total: float, active: float) -> None:
    m = ModelConfig.from_hf(config_dir(tmp_path, cfg, "m"))
    embeddings = 2 * m.vocab * m.hidden
    assert m.weight_bytes / m.dtype_bytes == pytest.approx(total, rel=0.02)
    assert m.layer_params + embeddings == pytest.approx(active, rel=0.04)


def test_analytic_profiles_of_moe_and_mla(tmp_path: Path) -> None:
    h200 = PRESETS["h200"]
    mixtral = ModelConfig.from_hf(config_dir(tmp_path, MIXTRAL_8X7B, "mixtral"))
    dense_twin = ModelConfig.from_hf(config_dir(tmp_path, MIXTRAL_8X7B | {
        "num_local_experts": 0}, "dense"))
    p_moe, p_dense = analytic_profile(mixtral, h200), analytic_profile(dense_twin, h200)
    # every expert is held and read each decode step; two of eight are computed per token
    assert p_moe.decode.a > 3.5 * p_dense.decode.a - 3 * h200.step_overhead_s
    assert p_moe.prefill.b == pytest.approx(p_dense.prefill.b * mixtral.layer_params
                                            / dense_twin.layer_params)
    assert p_moe.kv_capacity_tokens < p_dense.kv_capacity_tokens
    assert p_moe.model.kv_bytes_per_token == p_dense.model.kv_bytes_per_token

    v3 = ModelConfig.from_hf(config_dir(tmp_path, DEEPSEEK_V3, "v3"), dtype_bytes=1)  # FP8
    # attention's head is the query/key width (128 + 64), whatever `head_dim` a saved config
    # holds (transformers writes the rope part's)
    assert v3.head_dim == 192
    saved = ModelConfig.from_hf(config_dir(tmp_path, DEEPSEEK_V3 | {"head_dim": 64}, "saved"))
    assert saved.head_dim == 192
    p8 = analytic_profile(v3, h200, tp=8)
    assert p8.model.latent and p8.model.kv_bytes_per_token == 61 * 576
    # the latent is whole on each of the 8 ranks: 8 copies of every token's KV
    free = h200.memory_bytes * h200.mem_util * 8 - v3.weight_bytes
    assert p8.kv_capacity_tokens == int(free // (8 * 61 * 576))
    again = Profile.from_dict(p8.to_dict())
    assert again.model == p8.model
    assert "latent" not in analytic_profile(mixtral, h200, tp=2).to_dict()["model"]


def test_the_routers_kv_estimate_counts_a_latent_once(tmp_path: Path) -> None:
    assert kv_bytes_per_token(str(config_dir(tmp_path, LLAMA_8B, "l"))) == 2 * 32 * 8 * 128 * 4
    assert kv_bytes_per_token(str(config_dir(tmp_path, DEEPSEEK_V3, "d"))) == 61 * 576 * 4
    assert kv_bytes_per_token(str(tmp_path / "absent")) == 0
    assert kv_bytes_per_token(None) == 0
