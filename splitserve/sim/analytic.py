"""An analytic profile: step costs derived from a model config and a hardware spec (FLOP/s,
memory bandwidth, link bandwidth), for planning on hardware this machine does not have.

It is labelled `kind: "analytic"` and carries no engine timing; treat it as a roofline estimate,
not a measurement. The model:

- weights are read once per step: `a = overhead + weight_bytes / (mem_bw · mbu)`;
- prefill: `b = 2 · params / (flops · mfu)` per prompt token (dense matmuls),
  `c = 2 · layers · heads · head_dim / (flops · mfu)` (causal attention, QKᵀ and AV);
- decode step: `b = kv_bytes_per_token / (mem_bw · mbu)` per context token (reading the KV),
  `c = 2 · (params + vocab · hidden) / (flops · mfu)` per sequence;
- KV capacity = (memory · utilisation − weight bytes) / kv_bytes_per_token;
- KV transfer over the given link: bandwidth and latency as stated.
Summing the compute and memory terms (instead of taking the larger) overstates small steps a
little; it never understates them.

Tensor parallelism (`tp` GPUs a worker, Megatron-style as vLLM shards a dense model): FLOP/s,
memory bandwidth, memory and network links add up over the ranks (each reads and computes its
shard; each GPU has its own NIC); KV heads are split over the ranks, and replicated when there
are fewer KV heads than ranks (each rank holds ceil(kv_heads / tp)); and every layer pays two
all-reduces of its activations (attention out, MLP out), each a ring all-reduce:
`2 · (tp − 1) / tp · tokens · hidden · dtype_bytes / allreduce_bw` plus `allreduce_latency_s`.
The all-reduce's bytes are per token (a prefill's prompt tokens, a decode step's sequences);
its latency is per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from splitserve.common.modelconfig import MoeShape, kv_shape, moe_shape, read_config
from splitserve.sim.costmodel import DecodeCost, PrefillCost, TransferLink
from splitserve.sim.model import Engine, ModelShape, Profile


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense FLOP/s at the model's dtype
    mem_bw: float  # bytes/s
    memory_bytes: float
    link_bw: float  # bytes/s between a P and a D worker, per GPU (its NIC)
    # NCCL's all-reduce bus bandwidth between the GPUs of one node (bytes/s; 0: no TP link)
    allreduce_bw: float = 0.0
    allreduce_latency_s: float = 10e-6
    link_latency_s: float = 10e-6
    mfu: float = 0.5  # achieved share of peak FLOP/s
    mbu: float = 0.7  # achieved share of peak memory bandwidth
    step_overhead_s: float = 0.003  # scheduler, launches, sampling per step
    mem_util: float = 0.9
    # vLLM's OpenAI-server defaults on this GPU (vllm/engine/arg_utils.py): 8192 / 1024 on
    # H100/H200-class GPUs (>= 70 GiB, not A100), 2048 / 256 on the others
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        for k in ("flops", "mem_bw", "memory_bytes", "link_bw"):
            if not getattr(self, k) > 0:
                raise ValueError(f"Hardware.{k} must be positive")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1 and 0 < self.mem_util <= 1):
            raise ValueError("mfu, mbu and mem_util must be in (0, 1]")
        if self.link_latency_s < 0 or self.step_overhead_s < 0 or self.allreduce_latency_s < 0:
            raise ValueError("latencies must be >= 0")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


GB = 1e9
# Public datasheet peaks (dense BF16), one GPU; links are per-GPU network bandwidth. The
# all-reduce bus bandwidths are NCCL's typical achieved figures inside one node (NVLink 3 / 4:
# about 0.8 of the one-way peak of 300 / 450 GB/s; L40S: PCIe Gen4).
PRESETS: dict[str, Hardware] = {
    "a100-80g": Hardware("A100-SXM 80GB", 312e12, 2.039e12, 80 * 2**30, 25 * GB,
                         allreduce_bw=240 * GB),
    "h100-sxm": Hardware("H100-SXM 80GB", 989e12, 3.35e12, 80 * 2**30, 50 * GB,
                         allreduce_bw=360 * GB, max_num_batched_tokens=8192, max_num_seqs=1024),
    "h200": Hardware("H200 141GB", 989e12, 4.8e12, 141 * GB, 50 * GB, allreduce_bw=360 * GB,
                     max_num_batched_tokens=8192, max_num_seqs=1024),
    "l40s": Hardware("L40S 48GB", 362e12, 0.864e12, 48 * 2**30, 12.5 * GB,
                     allreduce_bw=20 * GB),
}
MAX_TP = 8  # the GPUs of one node: a TP group never spans nodes here


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    # MLA: the elements of the one latent a token keeps per layer (kv_lora_rank +
    # qk_rope_head_dim), held whole on every TP rank; 0: K and V of `kv_heads` heads
    latent_width: int = 0
    moe: MoeShape | None = None  # None: a dense gated MLP of `intermediate` in every layer
    attn_layer_params: int = 0  # one layer's attention projections; 0: grouped-query's

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                  "dtype_bytes"):
            if getattr(self, k) < 1:
                raise ValueError(f"ModelConfig.{k} must be >= 1")
        if self.latent_width < 0 or self.attn_layer_params < 0:
            raise ValueError("ModelConfig.latent_width and attn_layer_params must be >= 0")

    @classmethod
    def from_hf(cls, path: str | Path, dtype_bytes: int = 2) -> ModelConfig:
        cfg = read_config(path)
        heads = int(cfg["num_attention_heads"])
        kv = kv_shape(cfg)
        qk_dim = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0)
        return cls(name=cfg.get("_name_or_path") or Path(path).stem, layers=kv.layers,
                   hidden=cfg["hidden_size"], heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   # MLA: a head's query/key width (transformers stores head_dim as the
                   # rope part alone)
                   head_dim=int((qk_dim if kv.latent else 0) or cfg.get("head_dim")
                                or cfg["hidden_size"] // heads),
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                   dtype_bytes=dtype_bytes, latent_width=kv.head_dim if kv.latent else 0,
                   moe=moe_shape(cfg), attn_layer_params=mla_layer_params(cfg))

    def mlp_params(self) -> tuple[int, int]:
        """(held, computed per token): the MLPs' matmul parameters over all layers. An MoE
        layer holds every routed expert, its shared experts and its router, and computes
        `experts_per_token` routed experts, the shared ones and the router."""
        if self.moe is None:
            dense = self.layers * 3 * self.hidden * self.intermediate
            return dense, dense
        m = self.moe
        dense = m.dense_layers * 3 * self.hidden * self.intermediate
        expert = 3 * self.hidden * m.expert_intermediate
        always = 3 * self.hidden * m.shared_intermediate + self.hidden * m.experts
        return (dense + m.moe_layers * (m.experts * expert + always),
                dense + m.moe_layers * (m.experts_per_token * expert + always))

    @property
    def attn_params(self) -> int:
        """Attention's matmul parameters over all layers: `attn_layer_params` a layer, else
        grouped-query attention's Q, K, V and O projections."""
        return self.layers * (self.attn_layer_params or self.hidden * self.head_dim
                              * (2 * self.heads + 2 * self.kv_heads))

    @property
    def layer_params(self) -> int:
        """Matmul parameters a token computes in the transformer layers."""
        return self.attn_params + self.mlp_params()[1]

    @property
    def weight_bytes(self) -> int:
        """Every weight held (all experts of an MoE)."""
        return (self.attn_params + self.mlp_params()[0] + 2 * self.vocab * self.hidden) \
            * self.dtype_bytes

    def shape(self) -> ModelShape:
        if self.latent_width:
            return ModelShape(self.name, self.layers, 1, self.latent_width, self.dtype_bytes,
                              latent=True)
        return ModelShape(self.name, self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)


def mla_layer_params(cfg: dict[str, Any]) -> int:
    """One MLA layer's projections (DeepSeek-V2/V3's: Q through an optional low rank, the
    latent and its rope key, K and V up from the latent, O); 0 for other attention."""
    if not cfg.get("kv_lora_rank"):
        return 0
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    nope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    q_rank = int(cfg.get("q_lora_rank") or 0)
    q_out = heads * (nope + rope)
    q = hidden * q_rank + q_rank * q_out if q_rank else hidden * q_out
    return q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden


def check_tp(model: ModelConfig, hw: Hardware, tp: int) -> None:
    """ValueError unless `model` shards over `tp` GPUs of one `hw` node (vLLM's rule: the
    attention heads divide evenly)."""
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"tp must be 1..{MAX_TP} (the GPUs of one node), got {tp}")
    if model.heads % tp:
        raise ValueError(f"{model.name}'s {model.heads} attention heads do not split over "
                         f"tp={tp}")
    if tp > 1 and hw.allreduce_bw <= 0:
        raise ValueError(f"{hw.name} has no all-reduce bandwidth for tp={tp} (allreduce_bw)")


def allreduce_s(model: ModelConfig, hw: Hardware, tp: int) -> tuple[float, float]:
    """(seconds per step, seconds per token) of a step's all-reduces at `tp` (0 at tp=1)."""
    if tp == 1:
        return 0.0, 0.0
    per_token = 2 * (tp - 1) / tp * model.hidden * model.dtype_bytes / hw.allreduce_bw
    return 2 * model.layers * hw.allreduce_latency_s, 2 * model.layers * per_token


def analytic_profile(model: ModelConfig, hw: Hardware, token_budget: int | None = None,
                     transport: str = "rdma", tp: int = 1) -> Profile:
    """The roofline profile of one worker of `tp` GPUs running `model` on `hw`, with vLLM's
    scheduler defaults for that GPU (`token_budget` overrides its max_num_batched_tokens)."""
    check_tp(model, hw, tp)
    flops, bw = hw.flops * hw.mfu * tp, hw.mem_bw * hw.mbu * tp
    shape = model.shape()
    # KV stored per KV made: heads replicated where the ranks outnumber them; a latent on
    # every rank
    held = tp if model.latent_width else tp * -(-model.kv_heads // tp) / model.kv_heads
    kv_held = shape.kv_bytes_per_token * held
    step_s, token_s = allreduce_s(model, hw, tp)
    weights = hw.step_overhead_s + model.weight_bytes / bw + step_s
    prefill = PrefillCost(a=weights, b=2 * model.layer_params / flops + token_s,
                          c=2 * model.layers * model.heads * model.head_dim / flops)
    decode = DecodeCost(a=weights, b=kv_held / bw,
                        c=2 * (model.layer_params + model.vocab * model.hidden) / flops + token_s)
    free = hw.memory_bytes * hw.mem_util * tp - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} ({model.weight_bytes / GB:.1f} GB) does not fit in "
                         f"{tp} x {hw.name}")
    return Profile(
        kind="analytic", engine=Engine("analytic", "n/a"), model=shape,
        hardware={"name": hw.name, "tp": tp, "flops": hw.flops, "mem_bw": hw.mem_bw,
                  "memory_bytes": hw.memory_bytes, "link_bw": hw.link_bw,
                  "allreduce_bw": hw.allreduce_bw, "mfu": hw.mfu, "mbu": hw.mbu,
                  "step_overhead_s": hw.step_overhead_s,
                  "note": "analytic roofline estimate, not a measurement"},
        prefill=prefill, decode=decode, token_budget=token_budget or hw.max_num_batched_tokens,
        kv_capacity_tokens=int(free // kv_held), max_num_seqs=hw.max_num_seqs,
        transfer={transport: TransferLink(hw.link_bw * tp, hw.link_latency_s, "analytic")},
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def gpus_of(profile: Profile) -> int:
    """The GPUs one worker of `profile` takes (its TP; 1 for a measured profile)."""
    return profile.gpus
