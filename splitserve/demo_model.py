"""Small random checkpoints made on this machine: the embedded demo model and test models.

Nothing is downloaded. A checkpoint is a Hugging Face model directory: `config.json`, seeded
random weights as safetensors, and a byte-level BPE tokenizer trained with `tokenizers` on a
seeded synthetic corpus (with a chat template). The same seed gives the same bytes.

The embedded model (`embedded_model_dir()`) is a Llama-family model sized so that on one core of
a small CPU machine a decode step takes ~10-30 ms and a 2,000-token prefill ~1 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2")
# mixture-of-experts architectures: every layer's MLP is `num_experts` experts of
# `intermediate_size`, `experts_per_token` of them chosen per token (Qwen2-MoE and DeepSeek-V2
# add a shared expert of the same size; DeepSeek-V2's first layer keeps a dense MLP)
MOE_ARCHES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2")
# DeepSeek-V2's multi-head latent attention: vLLM-CPU's MLA kernel takes only this latent
# (kv_lora_rank 512 + a rope key of 64); `head_dim` is each head's no-rope query/key and value
MLA_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
# fields added after checkpoints were first named: left out of `identity()` at these values,
# so older checkpoints keep their names and bytes
LATER_DEFAULTS = {"attention_out_scale": 1.0, "num_experts": 0, "experts_per_token": 2}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a small random checkpoint. Validated on construction."""

    arch: str = "llama"
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 16384
    # A wide initializer keeps logits far apart, so greedy decoding has no near-ties between
    # implementations (float32 rounding differences cannot flip the argmax).
    initializer_range: float = 0.1
    seed: int = 0
    # Attention's output projections scaled by this: far below 1, attention adds little, the
    # next token depends mostly on the current one, and greedy output falls into a cycle (a
    # model on which n-gram speculative drafts are accepted). 1: the weights as drawn.
    attention_out_scale: float = 1.0
    num_experts: int = 0  # MoE architectures only (MOE_ARCHES), and required there
    experts_per_token: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"arch must be one of {ARCHES}, got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256):
            raise ValueError(f"head_dim {self.head_dim} is not supported by vLLM's CPU attention")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be at least 512")
        if not self.attention_out_scale > 0:
            raise ValueError("attention_out_scale must be positive")
        if (self.arch in MOE_ARCHES) != (self.num_experts > 0):
            raise ValueError(f"num_experts > 0 exactly for the MoE architectures {MOE_ARCHES}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError("experts_per_token must be in 1..num_experts")
        if self.num_experts and self.hidden_size % 32:
            raise ValueError("vLLM's CPU fused-MoE kernel needs hidden_size % 32 == 0")

    def identity(self) -> dict[str, Any]:
        """The fields that name the checkpoint (`LATER_DEFAULTS` left out at their values)."""
        return {k: v for k, v in self.__dict__.items()
                if k not in LATER_DEFAULTS or v != LATER_DEFAULTS[k]}

    def hf_config(self) -> dict[str, Any]:
        common = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        }
        if self.arch == "llama":
            common |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       "tie_word_embeddings": False, "attention_bias": False}
        elif self.arch == "qwen2":
            common |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                       "tie_word_embeddings": True, "use_sliding_window": False}
        elif self.arch == "qwen3":
            common |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                       "tie_word_embeddings": False, "attention_bias": False,
                       "use_sliding_window": False}
        else:
            common |= self._moe_config()
        return common | self.extra

    def _moe_config(self) -> dict[str, Any]:
        experts = {"num_experts_per_tok": self.experts_per_token, "tie_word_embeddings": False,
                   "output_router_logits": False, "router_aux_loss_coef": 0.0}
        if self.arch == "deepseek_v2":
            return experts | MLA_LATENT | {
                "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "n_routed_experts": self.num_experts, "n_shared_experts": 1,
                "moe_intermediate_size": self.intermediate_size, "first_k_dense_replace": 1,
                "moe_layer_freq": 1, "q_lora_rank": None, "qk_nope_head_dim": self.head_dim,
                "v_head_dim": self.head_dim, "topk_method": "greedy", "n_group": 1,
                "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                "scoring_func": "softmax", "attention_bias": False}
        if self.arch == "mixtral":
            return experts | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                              "num_local_experts": self.num_experts, "sliding_window": None}
        sparse = experts | {"num_experts": self.num_experts, "decoder_sparse_step": 1,
                            "mlp_only_layers": [], "use_sliding_window": False,
                            "moe_intermediate_size": self.intermediate_size}
        if self.arch == "qwen2_moe":
            return sparse | {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                             "shared_expert_intermediate_size": self.intermediate_size,
                             "norm_topk_prob": False}
        return sparse | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                         "attention_bias": False, "norm_topk_prob": True}


EMBEDDED_SPEC = ModelSpec()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """A seeded synthetic English-like corpus for training the tokenizer."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "pl", "ch", "sh", "th", "gr", "br"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck"]
    words = sorted({"".join(rng.choice(x) for x in (onsets, nuclei, codas, nuclei, codas))
                    for _ in range(3000)})
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choice(words) for _ in range(n)).capitalize() + rng.choice(".?!,;")
        lines.append(line)
    lines += [str(i) for i in range(1000)]
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_checkpoint(out_dir: str | os.PathLike[str], spec: ModelSpec = EMBEDDED_SPEC) -> Path:
    """Write a random checkpoint for `spec` into `out_dir` (created) and return its path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size, spec.seed)
    (out / "config.json").write_text(json.dumps(spec.hf_config(), indent=2))
    config = AutoConfig.from_pretrained(str(out))
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        # Random norms and biases too, so the checkpoint exercises every weight path.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, spec.initializer_range)
            if name.endswith("o_proj.weight") and spec.attention_out_scale != 1.0:
                p.mul_(spec.attention_out_scale)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "splitserve-spec.json").write_text(json.dumps(spec.identity(), sort_keys=True))
    return out


def spec_digest(spec: ModelSpec) -> str:
    return hashlib.sha256(json.dumps(spec.identity(), sort_keys=True).encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """The embedded demo model, generated on first use (a few seconds) and reused after."""
    root = (cache_dir or default_cache_dir()) / f"demo-model-{spec_digest(EMBEDDED_SPEC)}"
    if not (root / "model.safetensors").exists():
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        build_checkpoint(tmp, EMBEDDED_SPEC)
        try:
            tmp.rename(root)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return root
