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
`bytes / bandwidth + latency` per transport (`TransferLink`).

Disaggregated deployments add costs a plain worker's profile does not contain (`SplitCost`,
the optional `split` section, measured through a running deployment by `sim.calibrate`): the
router's time per request, P's slowdown while its connector pushes KV, the handover from t1 to
D's leg (router, KV load, D's admission), D's step cost as the client sees it through the
router, and the CPU that the router, client and connectors take from the engines' cores per
request (a mean-field stretch of every step, growing with the offered rate).

Every profile is stamped with the engine (name, version), the model, the hardware, and whether
it was measured or derived analytically. `load_profile` refuses a profile from another engine
version unless asked to accept it, in which case it comes back flagged (`mismatch`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

SCHEMA = "splitserve.profile/2"  # /2 added the optional `split` section
SCHEMAS: tuple[str, ...] = ("splitserve.profile/1", SCHEMA)  # /1 reads as "no split costs"
MAX_STRETCH = 10.0  # a stretch beyond this means the calibrated host is saturated
ProfileKind = Literal["measured", "analytic"]
PROFILE_KINDS: tuple[str, ...] = ("measured", "analytic")


def _finite_nonneg(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {v}")


Bins = tuple[tuple[float, int], ...]  # (seconds | ratio, weight per mille)


def _bins(raw: Any) -> Bins:
    return tuple((float(v), int(w)) for v, w in raw)


def _check_bins(owner: str, bins: Bins) -> None:
    if any(not math.isfinite(v) or w < 0 for v, w in bins):
        raise ValueError(f"{owner}.gap_jitter_s needs finite seconds and weights >= 0")


@dataclass(frozen=True)
class PrefillCost:
    """Seconds for one prefill step: a + b·Σq + c·Σ(q² + 2pq)."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        _finite_nonneg("PrefillCost", a=self.a, b=self.b, c=self.c)

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
        _finite_nonneg("DecodeCost", a=self.a, b=self.b, c=self.c)
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
        _finite_nonneg("TransferLink", latency_s=self.latency_s)

    def time(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps + self.latency_s


@dataclass(frozen=True)
class SplitCost:
    """What a disaggregated deployment costs beyond its workers' plain step times.

    - `router_request_s`: added to TTFT (client → router → P → router → client, beyond P's
      prefill);
    - `prefill_factor`: P's prefill steps relative to the profile's (the connector's sender
      thread gathers and pushes KV on P's core);
    - `handover_a_s + handover_b_s·prompt_len`: from t1 at the client to D's leg joining D's
      batch (router work, KV load, D's admission); D's first step comes on top;
    - `decode`: D's step cost as the client sees it through the router (replaces the profile's
      decode cost on D-workers);
    - `cpu_p_s`, `cpu_d_s`: core-seconds per request that the router, the client and the
      connectors take from P's and D's cores. At `r` requests/s per worker every step (and the
      handover) is stretched by `1 / (1 − r·cpu)` (mean field: the offered rate, not the
      instantaneous one). `calibrate` fits neither (the loaded stream's extra TTFT is
      `t1_relay_s` below; D's share is in `decode` and the event terms);
    - `p_busy_stretch`: D's decode steps take `1 + p_busy_stretch` times as long while its P
      (the P it shares cores with) is prefilling: P's engine then saturates its core and the
      router, client and API servers all run on D's;
    - `arrive_s`, `t1_s`, `join_s`, `finish_s`: seconds each request's events (arrival at the
      router, its first token t1, its leg joining D, its end) add to the step its D-worker is
      running then (the router's, the API servers' and the client's burst of work per event,
      landing on D's core). `join_s` is part of D's first step for the joining request (its
      join step), so the calibrated handover excludes it; `t2_s` is the relay of that step's
      token t2 (D's API server → router → client), on D's step after the join step;
    - `t1_relay_s`: seconds t1 waits for the router's relay when the request's D-worker runs
      streams then (the router and the client share D's cores: a lone request never waits;
      `calibrate` fits it to a loaded stream's median TTFT in place of `cpu_p_s`).
    - `interference`: the six terms above measured at several batch sizes, rows
      `(others, p_busy_stretch, arrive_s, t1_s, join_s, finish_s, t2_s)` by increasing
      `others`, the number of D's streams other than the event's request (for the stretch: D's
      streams); rows of six numbers (profiles from before `t2_s`) read with `t2_s` 0. When
      present it replaces the six scalars (which then hold the first row): `terms(others)`
      interpolates linearly between rows and holds the end rows' values outside them.
    """

    router_request_s: float
    prefill_factor: float
    handover_a_s: float
    handover_b_s: float
    decode: DecodeCost
    cpu_p_s: float = 0.0
    cpu_d_s: float = 0.0
    p_busy_stretch: float = 0.0
    arrive_s: float = 0.0
    t1_s: float = 0.0
    join_s: float = 0.0
    finish_s: float = 0.0
    t2_s: float = 0.0
    t1_relay_s: float = 0.0
    # the client's decode gaps over the step's mean, as (ratio, weight per mille) bins: the
    # jitter of steps and of the relay through the router at a fixed batch (empty: none)
    gap_noise: Bins = ()
    # the same jitter in seconds added to a gap, as (seconds, weight per mille) bins: it does not
    # grow with the gap (a gap carrying an event's work spreads no wider than a plain one);
    # replaces `gap_noise` when present
    gap_jitter_s: Bins = ()
    interference: tuple[tuple[float, ...], ...] = ()
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _finite_nonneg("SplitCost", router_request_s=self.router_request_s,
                       prefill_factor=self.prefill_factor, handover_a_s=self.handover_a_s,
                       handover_b_s=self.handover_b_s, cpu_p_s=self.cpu_p_s,
                       cpu_d_s=self.cpu_d_s, p_busy_stretch=self.p_busy_stretch,
                       arrive_s=self.arrive_s, t1_s=self.t1_s, join_s=self.join_s,
                       finish_s=self.finish_s, t2_s=self.t2_s, t1_relay_s=self.t1_relay_s)
        if self.prefill_factor <= 0:
            raise ValueError("SplitCost.prefill_factor must be > 0")
        if any(r < 0 or w < 0 for r, w in self.gap_noise):
            raise ValueError("SplitCost.gap_noise ratios and weights must be >= 0")
        _check_bins("SplitCost", self.gap_jitter_s)
        for row in self.interference:
            if len(row) not in (6, 7) or not all(math.isfinite(v) and v >= 0 for v in row):
                raise ValueError(f"SplitCost.interference rows are 7 (or 6) numbers >= 0: {row}")
        # invariant: every row has all seven (a six-number row predates t2_s: it is 0 there)
        object.__setattr__(self, "interference",
                           tuple(tuple(row) + (0.0,) * (7 - len(row)) for row in self.interference))
        if any(a[0] >= b[0] for a, b in zip(self.interference, self.interference[1:],
                                             strict=False)):
            raise ValueError("SplitCost.interference rows must have increasing batch sizes")

    @property
    def events(self) -> tuple[float, float, float, float, float]:
        """(arrive_s, t1_s, join_s, finish_s, t2_s)."""
        return self.arrive_s, self.t1_s, self.join_s, self.finish_s, self.t2_s

    def terms(self, others: float) -> tuple[float, float, float, float, float, float]:
        """(p_busy_stretch, arrive_s, t1_s, join_s, finish_s, t2_s) with `others` other streams
        on D: the `interference` rows interpolated linearly, held constant beyond the end rows;
        the scalars when there are no rows."""
        rows = self.interference
        if not rows:
            return (self.p_busy_stretch, *self.events)
        lo, hi = rows[0], rows[-1]
        for a, b in zip(rows, rows[1:], strict=False):
            if others <= b[0]:
                lo, hi = a, b
                break
        w = 0.0 if hi[0] == lo[0] else min(1.0, max(0.0, (others - lo[0]) / (hi[0] - lo[0])))
        v = [x + w * (y - x) for x, y in zip(lo[1:], hi[1:], strict=True)]
        return v[0], v[1], v[2], v[3], v[4], v[5]

    def term_table(self, n: int) -> list[tuple[float, float, float, float, float, float]]:
        """`terms(b)` for b = 0..n (the simulator's lookup by batch)."""
        return [self.terms(b) for b in range(n + 1)]

    def handover(self, prompt_len: int) -> float:
        return self.handover_a_s + self.handover_b_s * prompt_len

    @staticmethod
    def stretch(rate: float, cpu_s: float) -> float:
        """1 / (1 − rate·cpu), capped at MAX_STRETCH."""
        busy = rate * cpu_s
        return MAX_STRETCH if busy >= 1 - 1 / MAX_STRETCH else 1.0 / (1.0 - busy)

    def p_prefill(self, base: PrefillCost, rate_per_p: float) -> PrefillCost:
        k = self.prefill_factor * self.stretch(rate_per_p, self.cpu_p_s)
        return base.scaled(k)

    def d_decode(self, rate_per_d: float) -> DecodeCost:
        k = self.stretch(rate_per_d, self.cpu_d_s)
        return self.decode.scaled(k)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitCost:
        return cls(**{k: v for k, v in d.items()
                      if k not in ("decode", "gap_noise", "gap_jitter_s", "interference")},
                   decode=DecodeCost(**d["decode"]),
                   gap_noise=_bins(d.get("gap_noise", ())),
                   gap_jitter_s=_bins(d.get("gap_jitter_s", ())),
                   interference=tuple(tuple(float(v) for v in row)
                                      for row in d.get("interference", ())))


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
    max_num_seqs: int = 128  # vLLM's cap on running requests per engine (CPU default)
    fit: dict[str, Any] = field(default_factory=dict)  # measured points and fit quality
    created: str = ""
    split: SplitCost | None = None  # a disaggregated deployment's extra costs (sim.calibrate)
    # the client's decode gaps less their local pace at a fixed batch, as (seconds, weight per
    # mille) bins (`sim.jitter`), added to each simulated gap; a deployment's `split` costs
    # carry their own (through its router), which replace these on its workers
    gap_jitter_s: Bins = ()
    mismatch: str | None = None  # set by load_profile when accepted despite a version mismatch

    def __post_init__(self) -> None:
        if self.kind not in PROFILE_KINDS:
            raise ValueError(f"kind must be one of {PROFILE_KINDS}, got {self.kind!r}")
        if self.token_budget < 1 or self.kv_capacity_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("token_budget, kv_capacity_tokens and max_num_seqs must be >= 1")
        _check_bins("Profile", self.gap_jitter_s)

    def link(self, transport: str) -> TransferLink:
        if transport not in self.transfer:
            raise ValueError(f"profile has no transfer numbers for {transport!r} "
                             f"(has {sorted(self.transfer)})")
        return self.transfer[transport]

    def with_transfer(self, transport: str, link: TransferLink) -> Profile:
        return replace(self, transfer={**self.transfer, transport: link})

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
            max_num_seqs=int(d.get("max_num_seqs", 128)),
            transfer={k: TransferLink(**v) for k, v in d.get("transfer", {}).items()},
            fit=dict(d.get("fit", {})), created=d.get("created", ""),
            split=SplitCost.from_dict(d["split"]) if d.get("split") else None,
            gap_jitter_s=_bins(d.get("gap_jitter_s", ())),
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
