"""The machine's drift between a profile and a measurement, read off fixed canary probes.

On a shared machine the engines' speed drifts by 5–20 % within minutes (whoever else runs on
the cores): a profile describes the machine at the minute it was calibrated, and a measurement
four minutes later can be 15 % faster — an error no cost model can own.

The canaries are small and fixed (never the validated workload). `sim validate` runs them before
every measured repeat and after the last (a repeat stands for the mean of the canaries just
before and after it), and around its own profiling (kept for the record):

- the **speed canary** (`CanaryPlan`): lone requests of one prompt length, each decoding a few
  tokens; its median TTFT (prefill speed) and median decode gap (decode speed);
- for a disaggregated deployment, the **stretch canary** (`StretchPlan`, ~8 s): one decode
  stream on D, through the router, while a few long prompts prefill on P one after another;
  read like the interference probe at one background stream (`interference.gap_rows`,
  `interference.Pace`), its D-pace while P prefills over its pace while P idles is the P-busy
  stretch factor (1 + `p_busy_stretch`) of that minute (1.02–1.25× on a 2-vCPU KVM guest,
  drifting between minutes).

A repeat's `Drift` is its canaries (that mean) over the reference, the same canaries simulated on
the profile (`modelled_reference`): the TTFT ratio, the decode-gap ratio, and the stretch factor's
ratio (1.0 where either side has no stretch reading). So the drift-adjusted simulation is the
profile rescaled until it reproduces the canaries measured next to each repeat (not two
measured canaries around the profiling: 10 s samples, off the profiling's own minutes by up
to 11 %).
`scaled` applies a drift to a profile: prefill times by the first ratio; decode times, the gap
jitter and every per-event second on the decode side by the second; each P-busy stretch term k
(the scalar and every interference row's) to (1 + k) · ratio − 1, never below 0, by the third
(the factor, not k, is scaled: k is near 0 in some sessions, and a ratio of near-zero readings
is noise). The raw error is always reported next to the drift-adjusted one.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import Request
from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.calibration.interference import (
    InterferencePlan,
    Pace,
    Row,
    background_tokens,
    gap_rows,
    probe_stream,
    workload_rows,
)
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.profile import _prompt, _run
from splitserve.sim.records import request_records
from splitserve.sim.results import weighted_percentiles
from splitserve.sim.run import simulate
from splitserve.sim.workload import from_requests


@dataclass(frozen=True)
class CanaryPlan:
    """The speed canary: `requests` lone requests (one at a time) of `prompt` tokens, each
    decoding `tokens` tokens (~1.5 s on the demo model)."""

    prompt: int = 320
    tokens: int = 24
    requests: int = 5
    seed: int = 11

    def __post_init__(self) -> None:
        if self.prompt < 1 or self.tokens < 4 or self.requests < 1:
            raise ValueError("a canary needs a prompt, >= 4 tokens and >= 1 request")


@dataclass(frozen=True)
class StretchPlan:
    """The stretch canary: one stream (prompt `stream_prompt`) decodes on D while `prefills`
    prompts of `prompt` tokens arrive `spacing_s` apart from `first_s` on, each asking 3 tokens
    (t1, its leg joining D, its end), so P prefills each alone for ~0.3 s (the demo model on one
    core) and idles in between. The stream is sized to outlast the injections with a 1.5×
    margin at the given decode pace (`interference.background_tokens`): 826 tokens on the demo
    profile, ~8 s at 9 ms a step; ~100 clean gaps while P prefills, several hundred idle."""

    prompt: int = 1024
    prefills: int = 4
    stream_prompt: int = 128
    first_s: float = 0.8
    spacing_s: float = 1.0
    max_model_len: int = 4096
    seed: int = 13

    def __post_init__(self) -> None:
        if self.prompt < 1 or self.stream_prompt < 1:
            raise ValueError("the stretch canary needs positive prompt lengths")
        _ = self.probe  # InterferencePlan checks prefills (>= 3), first_s and spacing_s

    @property
    def probe(self) -> InterferencePlan:
        """The same canary as an interference probe at one background stream."""
        return InterferencePlan(bg_batches=(1,), bg_prompt=self.stream_prompt,
                                injections=self.prefills, inject_lens=(self.prompt,),
                                inject_tokens=3, first_s=self.first_s, spacing_s=self.spacing_s)


@dataclass(frozen=True)
class Drift:
    """A repeat's canaries over the reference (>1: slower now): prefill time, decode time, and
    the P-busy stretch factor (1 + `p_busy_stretch`); 1.0 where there is nothing to compare."""

    prefill: float = 1.0
    decode: float = 1.0
    stretch: float = 1.0


@dataclass(frozen=True)
class Speed:
    """One canary's median TTFT and median decode gap (seconds), and its P-busy stretch factor
    (`Pace.ratio` of the stretch canary; None: not measured, or too few clean gaps)."""

    ttft_s: float
    gap_s: float
    stretch: float | None = None

    @classmethod
    def of(cls, recs: list[RequestRecord], stretch: float | None = None) -> Speed:
        ttft = [r.chunk_times[0] - r.send_s for r in recs]
        # from t2 on: the first gap carries no prefill of its own, but is measured with the rest
        gaps = [b - a for r in recs
                for a, b in zip(r.chunk_times[1:], r.chunk_times[2:], strict=False)]
        return cls(statistics.median(ttft), statistics.median(gaps), stretch)

    @staticmethod
    def mean(speeds: list[Speed]) -> Speed:
        """The mean of each reading; the stretch over the canaries that have one."""
        stretch = [s.stretch for s in speeds if s.stretch is not None]
        return Speed(statistics.fmean(s.ttft_s for s in speeds),
                     statistics.fmean(s.gap_s for s in speeds),
                     statistics.fmean(stretch) if stretch else None)

    def drift(self, reference: Speed) -> Drift:
        """This canary's ratios to the reference; the stretch's is 1.0 unless both have one."""
        stretch = (self.stretch / reference.stretch
                   if self.stretch is not None and reference.stretch is not None else 1.0)
        return Drift(self.ttft_s / reference.ttft_s, self.gap_s / reference.gap_s, stretch)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Speed:
        """Reads what `to_dict` wrote."""
        stretch = d["stretch"]
        return cls(float(d["ttft_s"]), float(d["gap_s"]),
                   None if stretch is None else float(stretch))


def canary_requests(plan: CanaryPlan, spacing_s: float = 0.0) -> list[Request]:
    """The speed canary's requests (run one at a time; `spacing_s` apart for a simulation)."""
    rng = np.random.default_rng(plan.seed)
    return [Request(i, i * spacing_s, _prompt(rng, plan.prompt), plan.tokens)
            for i in range(plan.requests)]


def run_canary(url: str, plan: CanaryPlan = CanaryPlan()) -> Speed:
    """The speed canary (no stretch reading)."""
    return Speed.of(_run(url, canary_requests(plan), concurrency=1))


def _ratio(rows: list[Row]) -> float | None:
    try:
        return Pace.of(rows).ratio
    except RuntimeError:  # too few clean gaps while P idles
        return None


def stretch_of(recs: list[RequestRecord], decode: DecodeCost) -> float | None:
    """The stretch canary's records (the stream first) → D's pace while P prefills over its
    pace while P idles, each gap over `decode`'s step at its batch and context; None with too
    few clean gaps of either kind."""
    return _ratio(gap_rows(recs, 1, decode))


def workload_stretch(recs: list[RequestRecord], decode: DecodeCost) -> float | None:
    """The same factor read off a measured 1P+1D run's own records (all its streams' clean
    gaps, `interference.workload_rows`): what its canaries stood for."""
    return _ratio(workload_rows(recs, decode))


def run_stretch_canary(url: str, decode: DecodeCost, plan: StretchPlan = StretchPlan()
                       ) -> float | None:
    """The stretch canary against a disaggregated deployment's router (`stretch_of`). `decode`
    only shapes the step over batch and context: pass the same one for the reference and every
    repeat."""
    rng = np.random.default_rng(plan.seed)
    probe = plan.probe
    reqs = probe_stream(probe, 1, background_tokens(probe, 1, decode, plan.max_model_len),
                        lambda n: _prompt(rng, n))
    return stretch_of(_run(url, reqs, concurrency=None), decode)


RESEED = 1000  # `Canary.reseeded`'s seed step; more than any two plans' seeds differ


@dataclass(frozen=True)
class Canary:
    """What `sim validate` runs as the canary: the speed canary, and with `stretch` (a
    disaggregated deployment) the stretch canary read against `decode`."""

    speed: CanaryPlan = CanaryPlan()
    stretch: StretchPlan | None = None
    decode: DecodeCost | None = None

    def __post_init__(self) -> None:
        if self.stretch is not None and self.decode is None:
            raise ValueError("the stretch canary needs a decode cost to read gaps against")

    def reseeded(self, k: int) -> Canary:
        """The same canary with every prompt drawn at its plans' seeds + `RESEED` · `k`:
        canaries of different `k` share no prompt block (nor does a speed canary with any
        stretch canary: their plans' seeds differ by less than `RESEED`), so engines that keep
        prefix caches prefill each one whole. The lengths, all the reading depends on, stay."""
        step = RESEED * k
        stretch = None if self.stretch is None else replace(self.stretch,
                                                            seed=self.stretch.seed + step)
        return replace(self, speed=replace(self.speed, seed=self.speed.seed + step),
                       stretch=stretch)

    def run(self, url: str) -> Speed:
        speed = run_canary(url, self.speed)
        if self.stretch is None or self.decode is None:
            return speed
        return replace(speed, stretch=run_stretch_canary(url, self.decode, self.stretch))


class CanaryLog:
    """The canaries around a sequence of repeats on `url`: one when made, and one after each
    repeat (`after`), which gives that repeat the canaries just before and just after it
    (`canary`, `canary_after`, as `Speed.to_dict()`s). With `fresh`, the k-th canary is
    `canary.reseeded(k)`, for engines that keep prefix caches."""

    def __init__(self, canary: Canary, url: str, fresh: bool = False) -> None:
        self.canary, self.url, self.fresh = canary, url, fresh
        self.speeds: list[Speed] = []
        self._probe()

    def _probe(self) -> None:
        k = len(self.speeds)
        self.speeds.append((self.canary.reseeded(k) if self.fresh else self.canary).run(self.url))

    def after(self, run: dict[str, Any]) -> None:
        self._probe()
        run["canary"], run["canary_after"] = self.speeds[-2].to_dict(), self.speeds[-1].to_dict()


LONE_SPACING_S = 30.0  # the simulated speed canary's arrivals: each request runs alone


def modelled_reference(profile: Profile, cfg: SimConfig, canary: Canary) -> Speed:
    """The canary as `profile` predicts it on `cfg`: its requests simulated and read like the
    measured ones (`Speed.of`; the stretch canary's records by `stretch_of` against the same
    `canary.decode`). The speed canary's lone requests, run one at a time for real, arrive
    `LONE_SPACING_S` apart, as alone as the lone requests the split costs were fitted on. Its
    decode gaps carry the profile's gap jitter (the median over each gap spread over it), as
    the measured ones carry the machine's.

    Against this reference a repeat's drift is how much slower or faster the machine ran next
    to it than the profile describes — not than two canaries around the profiling, whose own
    10 s samples can be off the profiling's minutes by up to 11 %."""
    lone = canary_requests(canary.speed, LONE_SPACING_S)
    run = simulate(profile, cfg, from_requests(lone))
    recs, jitter = request_records(run), run.gap_jitter_s  # the jitter the simulator applies
    gaps = np.array([b - a for r in recs
                     for a, b in zip(r.chunk_times[1:], r.chunk_times[2:], strict=False)])
    ttft = statistics.median(r.chunk_times[0] - r.send_s for r in recs)
    speed = Speed(ttft, _jittered_median(gaps, jitter))
    if canary.stretch is None or canary.decode is None:
        return speed
    rng = np.random.default_rng(canary.stretch.seed)
    st, top = canary.stretch.probe, canary.stretch.max_model_len
    reqs = probe_stream(st, 1, background_tokens(st, 1, canary.decode, top),
                        lambda n: _prompt(rng, n))
    recs = request_records(simulate(profile, cfg, from_requests(reqs)))
    return replace(speed, stretch=stretch_of(recs, canary.decode))


def _jittered_median(gaps: np.ndarray, bins: tuple[tuple[float, int], ...]) -> float:
    """The median gap once each gap is spread over the jitter bins (seconds added, never below
    0; as `results.itl_samples` pools them)."""
    if not bins:
        return float(np.median(gaps))
    shift = np.array([v for v, _ in bins])
    weights = np.tile(np.array([w for _, w in bins], dtype=np.int64), len(gaps))
    values = np.maximum(gaps[:, None] + shift[None, :], 0.0).ravel()
    return float(weighted_percentiles(values, weights, (50.0,))[50.0])


def _stretched(k: float, ratio: float) -> float:
    """A P-busy stretch k whose factor 1 + k runs `ratio` times as high (>= 0; k at ratio 1)."""
    return k if ratio == 1.0 else max(0.0, (1.0 + k) * ratio - 1.0)


def _split(s: SplitCost, kd: float, ks: float) -> SplitCost:
    """D's steps, the router's and API servers' seconds per request and event (they run on D's core
    while P prefills), the handover and the gap jitter by `kd`; the P-busy stretch terms (the
    scalar, each row's) by `ks` (`_stretched`). `prefill_factor` (a ratio to the base profile)
    stays."""
    rows = tuple((row[0], _stretched(row[1], ks), *(v * kd for v in row[2:]))
                 for row in s.interference)
    return replace(
        s, router_request_s=s.router_request_s * kd, handover_a_s=s.handover_a_s * kd,
        handover_b_s=s.handover_b_s * kd, decode=s.decode.scaled(kd),
        p_busy_stretch=_stretched(s.p_busy_stretch, ks),
        arrive_s=s.arrive_s * kd, t1_s=s.t1_s * kd, join_s=s.join_s * kd,
        finish_s=s.finish_s * kd, t2_s=s.t2_s * kd, t1_relay_s=s.t1_relay_s * kd,
        interference=rows,
        gap_jitter_s=tuple((v * kd, w) for v, w in s.gap_jitter_s))


def scaled(profile: Profile, prefill: float, decode: float, stretch: float = 1.0) -> Profile:
    """`profile` on a machine whose prefill runs `prefill` and decode `decode` times as long,
    and where D's steps while P prefills stretch by a factor `stretch` times the profile's."""
    if not (prefill > 0 and decode > 0 and stretch > 0):
        raise ValueError(f"drift ratios must be positive, got {prefill}, {decode}, {stretch}")
    split = (_split(profile.split, decode, stretch) if profile.split is not None
             else None)
    return replace(profile, prefill=profile.prefill.scaled(prefill),
                   decode=profile.decode.scaled(decode), split=split,
                   gap_jitter_s=tuple((v * decode, w) for v, w in profile.gap_jitter_s))
