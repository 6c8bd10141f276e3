"""The cost model the simulator runs on, and the profile JSON that carries it.

A `Profile` says how long one engine step takes on one worker (DistServe's form):

- prefill step over prompt chunks q_i (each after p_i tokens already prefilled):
  `a + b·Σq + c·Σ(q² + 2·p·q)` — for unchunked prompts this is `a + b·Σl + c·Σl²`, and chunking
  a prompt keeps the quadratic (attention) part equal to `c·l²` while paying `a` per chunk;
- decode step: `a + b·Σcontext + c·batch`, plus a measured level per batch where the linear
  form misses (`DecodeCost.batch_levels`);
- a mixed step (decodes plus a prefill chunk, as vLLM's chunked prefill runs them) pays the
  larger of the two fixed costs once plus both variable parts.

KV transfer: bytes per token = `2 × layers × kv_heads × head_dim × dtype_bytes`; time =
`bytes / bandwidth + latency` per transport (`TransferLink`), pushed layer by layer during the
prefill (`transfer_arrival`: splitserve's connector) or pulled after it (`pull_arrival`: vLLM's
NixlConnector).

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
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from splitserve.sim.calibration.costs import SplitCost

SCHEMA = "splitserve.profile/2"  # /2 added the optional `split` section
SCHEMAS: tuple[str, ...] = ("splitserve.profile/1", SCHEMA)  # /1 reads as "no split costs"
# vLLM's OpenAI-server defaults on CPU (vllm/engine/arg_utils.py): what a measured CPU worker
# runs with unless told otherwise; GPU profiles carry their hardware's (`sim.analytic`)
VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_CPU_TOKEN_BUDGET = 2048
ProfileKind = Literal["measured", "analytic"]
PROFILE_KINDS: tuple[str, ...] = ("measured", "analytic")


def check_finite_nonneg(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {v}")


Bins = tuple[tuple[float, int], ...]  # (seconds | ratio, weight per mille)


def parse_bins(raw: Any) -> Bins:
    return tuple((float(v), int(w)) for v, w in raw)


def check_bins(owner: str, bins: Bins) -> None:
    if any(not math.isfinite(v) or w < 0 for v, w in bins):
        raise ValueError(f"{owner}.gap_jitter_s needs finite seconds and weights >= 0")


@dataclass(frozen=True)
class PrefillCost:
    """Seconds for one prefill step: a + b·Σq + c·Σ(q² + 2pq)."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        check_finite_nonneg("PrefillCost", a=self.a, b=self.b, c=self.c)

    def time(self, tokens: float, quad: float) -> float:
        """`tokens` = Σq, `quad` = Σ(q² + 2pq)."""
        return self.a + self.b * tokens + self.c * quad

    def whole(self, prompt_len: int) -> float:
        """One unchunked prompt alone in a step."""
        return self.a + self.b * prompt_len + self.c * prompt_len * prompt_len

    def scaled(self, k: float) -> PrefillCost:
        """The same cost on a machine that runs `k` times as slow."""
        return PrefillCost(self.a * k, self.b * k, self.c * k)


@dataclass(frozen=True)
class DecodeCost:
    """Seconds for one decode step: a + b·Σcontext + c·batch + level(batch).

    `batch_levels` ((batch, seconds) in increasing batch; empty: level 0) is what the measured
    steps at that batch take beyond the linear form; `level` interpolates linearly between the
    measured batches and holds the end values beyond them. Through a router whose host shares
    D's core with the router, the client and the API servers, D's step is not linear in its
    batch (B = 2 steps 1.04–1.27× the linear fit, B = 4 0.84–0.96×, on the demo deployment),
    so the calibration keeps each batch's level."""

    a: float
    b: float
    c: float = 0.0
    batch_levels: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        check_finite_nonneg("DecodeCost", a=self.a, b=self.b, c=self.c)
        levels = tuple((int(n), float(s)) for n, s in self.batch_levels)
        object.__setattr__(self, "batch_levels", levels)
        if any(n < 1 or not math.isfinite(s) for n, s in levels):
            raise ValueError("DecodeCost.batch_levels needs batches >= 1 and finite seconds")
        if any(m >= n for (m, _), (n, _) in zip(levels, levels[1:], strict=False)):
            raise ValueError("DecodeCost.batch_levels must be in increasing batch")
        if any(self.a + self.c * n + s <= 0 for n, s in levels):
            raise ValueError("DecodeCost.batch_levels make a step at some batch take no time")

    def level(self, batch: int) -> float:
        lv = self.batch_levels
        if not lv:
            return 0.0
        if batch <= lv[0][0]:
            return lv[0][1]
        for (m, x), (n, y) in zip(lv, lv[1:], strict=False):
            if batch <= n:
                return x + (y - x) * (batch - m) / (n - m)
        return lv[-1][1]

    def batch_term(self, batch: int) -> float:
        """The part of a step that depends on its batch alone: c·batch + level(batch)."""
        return self.c * batch + self.level(batch)

    def time(self, batch: int, context: float) -> float:
        return self.a + self.b * context + self.batch_term(batch)

    def scaled(self, k: float) -> DecodeCost:
        """The same cost on a machine that runs `k` times as slow."""
        return DecodeCost(self.a * k, self.b * k, self.c * k,
                          tuple((n, s * k) for n, s in self.batch_levels))


@dataclass(frozen=True)
class TransferLink:
    """One transport's KV transfer: time = bytes / bandwidth + latency."""

    bandwidth_Bps: float
    latency_s: float = 0.0
    source: str = "default"  # where the numbers came from (benchmark JSON path, "analytic", ...)

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth_Bps must be positive, got {self.bandwidth_Bps}")
        check_finite_nonneg("TransferLink", latency_s=self.latency_s)

    def time(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps + self.latency_s


@dataclass(frozen=True)
class ModelShape:
    """What the cost of moving KV depends on."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for k in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, k) < 1:
                raise ValueError(f"ModelShape.{k} must be >= 1")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


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
            split=_split_from_dict(d["split"]) if d.get("split") else None,
            gap_jitter_s=parse_bins(d.get("gap_jitter_s", ())),
        )


def _split_from_dict(d: dict[str, Any]) -> SplitCost:
    # the split section is the calibration's (imported here: it builds on this module's costs)
    from splitserve.sim.calibration.costs import SplitCost

    return SplitCost.from_dict(d)


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


def transfer_arrival(link: TransferLink, nbytes: float, layers: int, prefill_start: float,
                     prefill_end: float, overlap: bool, link_free: float = 0.0
                     ) -> tuple[float, float]:
    """When a prompt's KV is all at D, and when the link is free again.

    Without overlap the whole KV goes after the prefill: it starts when the prefill ends and the
    link is free. With layer-wise overlap, layer i's KV can leave once layer i is computed (layers
    take equal time); the last layer's share still has to cross after the prefill ends. The link
    is a FIFO server: a transfer starts no earlier than `link_free`.
    """
    send = nbytes / link.bandwidth_Bps
    if not overlap:
        start = max(prefill_end, link_free)
        end = start + send
    else:
        first_ready = prefill_start + (prefill_end - prefill_start) / layers
        start = max(first_ready, link_free)
        end = max(start + send, prefill_end + send / layers)
    return end + link.latency_s, end


def pull_arrival(link: TransferLink, nbytes: float, ready: float, link_free: float = 0.0
                 ) -> tuple[float, float]:
    """When a prompt's KV is all at D, and when the link is free again, for a pull (vLLM's
    NixlConnector): D reads P's whole blocks from `ready` (its leg reached it, after P's
    prefill ended), so the whole transfer is exposed. FIFO link, as `transfer_arrival`."""
    start = max(ready, link_free)
    end = start + nbytes / link.bandwidth_Bps
    return end + link.latency_s, end
