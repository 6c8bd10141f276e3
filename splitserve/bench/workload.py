"""Request streams for the benchmark: lengths, prompts and arrival times, fixed by a seed.

A `WorkloadSpec` (frozen, validated, JSON-serialisable with `to_dict`/`from_dict`) fully
determines a stream: `build_stream(spec)` returns the same `Request`s — prompt token ids, output
lengths, arrival offsets — on every call and every machine. Prompts are lists of token ids, so
input lengths are exact on any server that accepts token-id prompts (vLLM's `/v1/completions`).

Sources of lengths: `fixed`, `uniform`, `normal` (per `LengthDist`), a ShareGPT JSON file
(lengths taken from its conversations, approximated as ~4 characters per token), a CSV trace
(`arrival_s,input_len,output_len` — its arrival times are replayed as they are), the
`interference` mix defined once here (`INTERFERENCE`, also stated in the README), and two
sources whose prompts repeat prefixes (repeat.py): a Mooncake-format trace (`mooncake`, see
mooncake.py) and chat sessions (`multiturn`, see multiturn.py: closed-loop when run; its
`build_stream` is the open-loop plan). Their requests carry their prefix identity (`hash_ids`,
`session`, `turn`).

Arrivals (`ArrivalSpec`): `poisson`; `gamma` with a burstiness factor k (gaps ~
Gamma(shape=k, scale=1/(rate·k)); k = 1 is Poisson, k < 1 burstier); `constant`; `ramp` (rate
moves linearly from `rate` to `ramp_end_rate` over the stream; Poisson gaps at the current
rate); `closed` (every request is ready at t=0 and `max_concurrency` caps how many are in
flight). Unlike vLLM's `bench serve`, gaps are *not* rescaled so that the last send lands at
N/rate: the process is a pure renewal process of the stated rate. `max_concurrency` may cap any
arrival kind; a request's clock starts when it is actually sent.

Warm-up: `warmup` extra requests, drawn from a separate seeded stream of the same shape, are
sent before the measured run and excluded from every metric.

The simulator (splitserve/sim) reuses `WorkloadSpec`, `build_stream` and `Request`.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from splitserve.bench.repeat import MooncakeOptions, MultiturnOptions

LengthKind = Literal["fixed", "uniform", "normal"]
ArrivalKind = Literal["poisson", "gamma", "constant", "ramp", "closed"]
Source = Literal["synthetic", "interference", "sharegpt", "trace", "mooncake", "multiturn"]

LENGTH_KINDS: tuple[str, ...] = ("fixed", "uniform", "normal")
ARRIVAL_KINDS: tuple[str, ...] = ("poisson", "gamma", "constant", "ramp", "closed")
SOURCES: tuple[str, ...] = ("synthetic", "interference", "sharegpt", "trace", "mooncake",
                            "multiturn")
# Token ids used for synthetic prompts: above the special tokens, below any small vocabulary.
_TOKEN_LOW, _TOKEN_HIGH = 10, 500


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: `fixed` (= mean), `uniform` [low, high], or `normal` (mean, std) clipped
    to [low, high]."""

    kind: LengthKind = "fixed"
    mean: int = 128
    low: int = 1
    high: int = 4096
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low} high={self.high}")
        if self.kind != "uniform" and not self.low <= self.mean <= self.high:
            raise ValueError(f"mean {self.mean} outside [{self.low}, {self.high}]")
        if self.std < 0:
            raise ValueError("std must be >= 0")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.mean] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]
        vals = np.rint(rng.normal(self.mean, self.std, size=n))
        return [int(x) for x in np.clip(vals, self.low, self.high)]


@dataclass(frozen=True)
class ArrivalSpec:
    """When requests are sent. `rate` is requests per second (ignored for `closed`)."""

    kind: ArrivalKind = "poisson"
    rate: float = 1.0
    burstiness: float = 1.0  # gamma shape k; 1 = Poisson, < 1 burstier
    ramp_end_rate: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrival kind must be one of {ARRIVAL_KINDS}, got {self.kind!r}")
        if self.kind != "closed" and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive finite number, got {self.rate}")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be positive")
        if self.kind == "ramp" and (self.ramp_end_rate is None or self.ramp_end_rate <= 0):
            raise ValueError("a ramp needs a positive ramp_end_rate")
        if self.kind == "closed" and not self.max_concurrency:
            raise ValueError("closed-loop arrivals need max_concurrency")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")

    def gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n inter-arrival gaps in seconds (the first request waits the first gap)."""
        if self.kind == "closed":
            return np.zeros(n)
        if self.kind == "constant":
            return np.full(n, 1.0 / self.rate)
        if self.kind == "poisson":
            return rng.exponential(1.0 / self.rate, size=n)
        if self.kind == "gamma":
            k = self.burstiness
            return rng.gamma(shape=k, scale=1.0 / (self.rate * k), size=n)
        assert self.ramp_end_rate is not None
        rates = np.linspace(self.rate, self.ramp_end_rate, n) if n > 1 else np.array([self.rate])
        return rng.exponential(1.0, size=n) / rates


@dataclass(frozen=True)
class InterferenceMix:
    """Steady short chat requests plus periodic long-document prompts (see README)."""

    duration_s: float = 40.0
    short_rate: float = 2.0  # Poisson, requests/s
    short_input: LengthDist = LengthDist("uniform", 96, 32, 160)
    short_output: LengthDist = LengthDist("uniform", 96, 64, 128)
    long_period_s: float = 6.0  # one long prompt every period, first at period/2
    long_input: LengthDist = LengthDist("uniform", 1800, 1600, 2000)
    long_output: LengthDist = LengthDist("fixed", 16, 1, 4096)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.short_rate <= 0 or self.long_period_s <= 0:
            raise ValueError("duration_s, short_rate and long_period_s must be positive")


INTERFERENCE = InterferenceMix()


@dataclass(frozen=True)
class Request:
    """One request of a stream. `arrival_s` is its offset from the start of the run."""

    index: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    kind: str = "normal"  # "short", "long" (interference), "first-turn", "follow-up"
    warmup: bool = False
    # Prefix identity. mooncake: the trace's hash ids (blocks of spec.mooncake's
    # scaled_block_tokens) and the prefix tree's number; multiturn: the session and turn.
    hash_ids: tuple[int, ...] = ()
    session: int | None = None
    turn: int | None = None

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that fixes a request stream. `num_requests` is ignored for `interference`
    (its duration decides), `trace` and `mooncake` (their rows decide) and `multiturn`
    (sessions × turns). `mooncake` / `multiturn` read their own parts only."""

    source: Source = "synthetic"
    num_requests: int = 100
    input: LengthDist = LengthDist("fixed", 128)
    output: LengthDist = LengthDist("fixed", 64)
    arrival: ArrivalSpec = ArrivalSpec()
    interference: InterferenceMix = INTERFERENCE
    path: str | None = None  # ShareGPT JSON, trace CSV or Mooncake JSONL
    seed: int = 0
    warmup: int = 2
    mooncake: MooncakeOptions = MooncakeOptions()
    multiturn: MultiturnOptions = MultiturnOptions()

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.source in ("sharegpt", "trace", "mooncake") and not self.path:
            raise ValueError(f"source {self.source!r} needs a path")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        mix = dict(d.get("interference", {}))
        for key in ("short_input", "short_output", "long_input", "long_output"):
            if key in mix:
                mix[key] = LengthDist(**mix[key])
        return cls(
            source=d.get("source", "synthetic"), num_requests=d.get("num_requests", 100),
            input=LengthDist(**d.get("input", {})), output=LengthDist(**d.get("output", {})),
            arrival=ArrivalSpec(**d.get("arrival", {})), interference=InterferenceMix(**mix),
            path=d.get("path"), seed=d.get("seed", 0), warmup=d.get("warmup", 2),
            mooncake=MooncakeOptions(**d.get("mooncake", {})),
            multiturn=MultiturnOptions(**d.get("multiturn", {})),
        )

    @property
    def unpaced(self) -> str | None:
        """Why no request rate sets when this workload's requests are sent (a trace's or
        Mooncake's own timestamps, closed-loop arrivals), for a rate sweep to refuse it; None
        when a rate does."""
        if self.source in ("trace", "mooncake") or self.arrival.kind == "closed":
            what = "closed-loop" if self.arrival.kind == "closed" else f"a {self.source}"
            return (f"{what} workload is sent on its own clock, not at a rate: a rate sweep "
                    "needs an open-loop arrival (--request-rate)")
        return None

    @property
    def rate_unit(self) -> str:
        """What `with_rate`'s rate counts: session starts for `multiturn` (each session sends
        its turns as its answers come), requests for the others."""
        return "sessions/s" if self.source == "multiturn" else "req/s"

    def with_rate(self, rate: float) -> WorkloadSpec:
        """The same workload at another request rate (for a rate sweep). For `interference`
        the rate is that of the short requests; the long-prompt period is unchanged; for
        `multiturn`, that of session starts; for an `unpaced` one, nothing changes."""
        if self.source == "interference":
            return replace(self, interference=replace(self.interference, short_rate=rate))
        return replace(self, arrival=replace(self.arrival, rate=rate))


def _prompt(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=n))


def _arrivals(spec: WorkloadSpec, rng: np.random.Generator, n: int) -> list[float]:
    return [float(x) for x in np.cumsum(spec.arrival.gaps(rng, n))]


def _synthetic(spec: WorkloadSpec, rng: np.random.Generator, n: int) -> list[Request]:
    ins, outs = spec.input.sample(rng, n), spec.output.sample(rng, n)
    times = _arrivals(spec, rng, n)
    return [Request(i, times[i], _prompt(rng, ins[i]), outs[i]) for i in range(n)]


def _interference(mix: InterferenceMix, rng: np.random.Generator) -> list[Request]:
    shorts: list[tuple[float, str]] = []
    t = float(rng.exponential(1.0 / mix.short_rate))
    while t < mix.duration_s:
        shorts.append((t, "short"))
        t += float(rng.exponential(1.0 / mix.short_rate))
    longs: list[tuple[float, str]] = []
    k = 0
    while (t := mix.long_period_s * (k + 0.5)) < mix.duration_s:
        longs.append((t, "long"))
        k += 1
    out: list[Request] = []
    for i, (t, kind) in enumerate(sorted(shorts + longs)):
        ind, outd = ((mix.short_input, mix.short_output) if kind == "short"
                     else (mix.long_input, mix.long_output))
        n_in, n_out = ind.sample(rng, 1)[0], outd.sample(rng, 1)[0]
        out.append(Request(i, t, _prompt(rng, n_in), n_out, kind=kind))
    return out


def _sharegpt_lengths(path: str) -> list[tuple[int, int]]:
    """(input, output) lengths from ShareGPT conversations: first human turn, first gpt answer."""
    data = json.loads(Path(path).read_text())
    pairs = []
    for item in data:
        turns = item.get("conversations", [])
        if len(turns) < 2:
            continue
        n_in = max(1, len(turns[0].get("value", "")) // 4)
        n_out = max(1, len(turns[1].get("value", "")) // 4)
        pairs.append((n_in, n_out))
    if not pairs:
        raise ValueError(f"{path}: no conversations with at least two turns")
    return pairs


def _sharegpt(spec: WorkloadSpec, rng: np.random.Generator) -> list[Request]:
    pairs = _sharegpt_lengths(str(spec.path))
    picks = rng.integers(0, len(pairs), size=spec.num_requests)
    times = _arrivals(spec, rng, spec.num_requests)
    return [Request(i, times[i], _prompt(rng, pairs[p][0]), pairs[p][1])
            for i, p in enumerate(picks)]


def read_trace(path: str) -> list[tuple[float, int, int]]:
    """Rows of a trace CSV: `arrival_s,input_len,output_len` (a header row is allowed)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0].strip().startswith("#"):
                continue
            try:
                rows.append((float(row[0]), int(row[1]), int(row[2])))
            except ValueError:
                if rows:  # only the first row may be a header
                    raise
    if not rows:
        raise ValueError(f"{path}: no trace rows")
    return sorted(rows)


def _trace(spec: WorkloadSpec, rng: np.random.Generator) -> list[Request]:
    rows = read_trace(str(spec.path))
    t0 = rows[0][0]
    return [Request(i, t - t0, _prompt(rng, n_in), n_out)
            for i, (t, n_in, n_out) in enumerate(rows)]


def build_stream(spec: WorkloadSpec) -> list[Request]:
    """The measured requests of `spec`, sorted by arrival. Same spec, same stream."""
    rng = np.random.default_rng(spec.seed)
    if spec.source == "interference":
        return _interference(spec.interference, rng)
    if spec.source == "sharegpt":
        return _sharegpt(spec, rng)
    if spec.source == "trace":
        return _trace(spec, rng)
    if spec.source == "mooncake":
        from splitserve.bench.mooncake import build_mooncake

        return build_mooncake(spec)
    if spec.source == "multiturn":
        from splitserve.bench.multiturn import build_multiturn

        return build_multiturn(spec)
    return _synthetic(spec, rng, spec.num_requests)


def build_warmup(spec: WorkloadSpec) -> list[Request]:
    """`spec.warmup` requests sent before the run (short-prompt shape, separate seed)."""
    if spec.warmup == 0:
        return []
    rng = np.random.default_rng([spec.seed, 1])
    src = spec.interference.short_input if spec.source == "interference" else spec.input
    ins = src.sample(rng, spec.warmup) if spec.source in ("synthetic", "interference") \
        else [64] * spec.warmup
    return [Request(-1 - i, 0.0, _prompt(rng, ins[i]), 8, kind="warmup", warmup=True)
            for i in range(spec.warmup)]


def stream_digest(requests: list[Request]) -> str:
    """A short hash of a stream, to show two runs used the identical requests."""
    import hashlib

    h = hashlib.sha256()
    for r in requests:
        h.update(f"{r.index},{r.arrival_s:.9f},{r.output_len},{r.kind}:".encode())
        h.update(",".join(map(str, r.prompt_token_ids)).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class StreamSummary:
    """What a stream asks for, for the run sheet."""

    requests: int
    duration_s: float
    offered_rate: float
    input_tokens: int
    output_tokens: int
    long_prompts: int
    digest: str = field(default="")


def summarize(requests: list[Request]) -> StreamSummary:
    dur = max((r.arrival_s for r in requests), default=0.0)
    return StreamSummary(
        requests=len(requests), duration_s=dur,
        offered_rate=(len(requests) / dur) if dur > 0 else 0.0,
        input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        long_prompts=sum(r.kind == "long" for r in requests), digest=stream_digest(requests),
    )
