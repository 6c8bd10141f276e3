"""The profile JSON (`Profile`): one worker type's costs, stamped with where they came from.

A profile carries the step and transfer cost model (`sim.costmodel`: `PrefillCost`,
`DecodeCost`, a `TransferLink` per transport), the model's shape (KV bytes per token =
`2 × layers × kv_heads × head_dim × dtype_bytes`), the engine's limits (token budget, running
requests, KV capacity), its gap jitter, and the measured points its fits came from.

A deployment whose router, client and workers share a few CPU cores costs more than its
workers' plain step times; the optional `split` section holds those costs
(`splitserve.sim.calibration.costs.SplitCost`, measured through a running deployment by
`splitserve.sim.calibration.calibrate`).

Every profile is stamped with the engine (name, version), the model, the hardware, and whether
it was measured or derived analytically. `load_profile` refuses a profile from another engine
version unless asked to accept it, in which case it comes back flagged (`mismatch`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.costmodel import (
    Bins,
    DecodeCost,
    PrefillCost,
    TransferLink,
    check_bins,
    parse_bins,
)

SCHEMA = "splitserve.profile/2"  # /2 added the optional `split` section
SCHEMAS: tuple[str, ...] = ("splitserve.profile/1", SCHEMA)  # /1 reads as "no split costs"
# vLLM's OpenAI-server defaults on CPU (vllm/engine/arg_utils.py): what a measured CPU worker
# runs with unless told otherwise; GPU profiles carry their hardware's (`sim.analytic`)
VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_CPU_TOKEN_BUDGET = 2048
ProfileKind = Literal["measured", "analytic"]
PROFILE_KINDS: tuple[str, ...] = ("measured", "analytic")


@dataclass(frozen=True)
class ModelShape:
    """What the cost of moving KV depends on."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    # MLA: one latent of `head_dim` per token and layer (kv_heads 1), not a K and a V
    # (`common.modelconfig.KvShape`)
    latent: bool = False

    def __post_init__(self) -> None:
        for k in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, k) < 1:
                raise ValueError(f"ModelShape.{k} must be >= 1")

    @property
    def kv_bytes_per_token(self) -> int:
        return ((1 if self.latent else 2) * self.layers * self.kv_heads * self.head_dim
                * self.dtype_bytes)


@dataclass(frozen=True)
class Engine:
    name: str = "vllm"
    version: str = "unknown"


@dataclass(frozen=True)
class Profile:
    """One worker type's cost model, stamped with where it came from."""

    kind: ProfileKind
    engine: Engine
    model: ModelShape
    hardware: dict[str, Any]
    prefill: PrefillCost
    decode: DecodeCost
    token_budget: int  # max_num_batched_tokens of the measured engine
    kv_capacity_tokens: int
    transfer: dict[str, TransferLink] = field(default_factory=dict)
    max_num_seqs: int = VLLM_CPU_MAX_NUM_SEQS  # vLLM's cap on running requests per engine
    fit: dict[str, Any] = field(default_factory=dict)  # measured points and fit quality
    created: str = ""
    split: SplitCost | None = None  # shared-core costs of a deployment (sim.calibration)
    # the client's decode gaps less their local pace at a fixed batch, as (seconds, weight per
    # mille) bins (`sim.calibration.jitter`), added to each simulated gap; a deployment's
    # `split` costs carry their own (through its router), which replace these on its workers
    gap_jitter_s: Bins = ()
    mismatch: str | None = None  # set by load_profile when accepted despite a version mismatch

    def __post_init__(self) -> None:
        if self.kind not in PROFILE_KINDS:
            raise ValueError(f"kind must be one of {PROFILE_KINDS}, got {self.kind!r}")
        if self.token_budget < 1 or self.kv_capacity_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("token_budget, kv_capacity_tokens and max_num_seqs must be >= 1")
        check_bins("Profile", self.gap_jitter_s)

    @property
    def gpus(self) -> int:
        """The GPUs one worker of this profile takes: its TP (`hardware.tp`; 1 when unset)."""
        return int(self.hardware.get("tp", 1))

    def link(self, transport: str) -> TransferLink:
        if transport not in self.transfer:
            raise ValueError(f"profile has no transfer numbers for {transport!r} "
                             f"(has {sorted(self.transfer)})")
        return self.transfer[transport]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("mismatch")
        d["schema"] = SCHEMA
        d["model"]["kv_bytes_per_token"] = self.model.kv_bytes_per_token
        if not self.model.latent:  # a K and a V, as every profile before MLA had
            del d["model"]["latent"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("schema") not in SCHEMAS:
            raise ValueError(f"not a splitserve profile (schema {d.get('schema')!r}, "
                             f"expected one of {SCHEMAS})")
        model = {k: v for k, v in d["model"].items() if k != "kv_bytes_per_token"}
        return cls(
            kind=d["kind"], engine=Engine(**d["engine"]), model=ModelShape(**model),
            hardware=dict(d.get("hardware", {})), prefill=PrefillCost(**d["prefill"]),
            decode=DecodeCost(**d["decode"]), token_budget=int(d["token_budget"]),
            kv_capacity_tokens=int(d["kv_capacity_tokens"]),
            max_num_seqs=int(d["max_num_seqs"]),
            transfer={k: TransferLink(**v) for k, v in d.get("transfer", {}).items()},
            fit=dict(d.get("fit", {})), created=d.get("created", ""),
            split=SplitCost.from_dict(d["split"]) if d.get("split") else None,
            gap_jitter_s=parse_bins(d.get("gap_jitter_s", ())),
        )


class ProfileMismatch(ValueError):
    """The profile was measured on another engine version than the one it is used with."""


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")


def load_profile(path: str | Path, engine_version: str | None = None,
                 accept_mismatch: bool = False) -> Profile:
    """Read a profile. If `engine_version` is given and differs from the profile's (ignoring a
    local `+cpu` suffix), raise `ProfileMismatch` — or, with `accept_mismatch`, return the
    profile with `mismatch` saying what differs. Analytic profiles carry no engine timing and
    are never refused for the version."""
    profile = Profile.from_dict(json.loads(Path(path).read_text()))
    if engine_version is None or profile.kind == "analytic":
        return profile
    want, have = engine_version.split("+")[0], profile.engine.version.split("+")[0]
    if want == have:
        return profile
    msg = (f"profile {path} was measured on {profile.engine.name} {profile.engine.version}, "
           f"but this engine is {engine_version}: its step times may not hold")
    if not accept_mismatch:
        raise ProfileMismatch(msg + " (re-profile, or accept the mismatch explicitly)")
    return replace(profile, mismatch=msg)


