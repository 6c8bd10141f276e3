"""The machine's drift between a profile and a measurement, read off a fixed canary probe.

On a shared machine the engines' speed drifts by 5–20 % within minutes (whoever else runs on
the cores): a profile calibrated at 04:44 describes the machine at 04:44, and a measurement at
04:48 can run 15 % faster — an error no cost model can own (`sim validate` run 6: every decode
metric +27..+50 %, calibrated decode step 9.4 ms against 8.1 ms measured minutes later).

The canary is small and fixed (lone requests of one prompt length, each decoding a few tokens;
never the validated workload). `sim validate` runs it around the calibration (the reference)
and before every measured repeat; the ratio of its median TTFT (prefill speed) and of its median
decode gap (decode speed) to the reference is that repeat's drift. `scaled` applies a drift to
a profile: prefill times by the first ratio, decode times, the gap jitter and every per-event
second on the decode side by the second. The raw error is always reported next to the
drift-adjusted one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import numpy as np

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import Request
from splitserve.sim.model import DecodeCost, PrefillCost, Profile, SplitCost
from splitserve.sim.profile import _prompt, _run


@dataclass(frozen=True)
class CanaryPlan:
    prompt: int = 320
    tokens: int = 24
    requests: int = 5
    seed: int = 11

    def __post_init__(self) -> None:
        if self.prompt < 1 or self.tokens < 4 or self.requests < 1:
            raise ValueError("a canary needs a prompt, >= 4 tokens and >= 1 request")


@dataclass(frozen=True)
class Speed:
    """One canary's median TTFT and median decode gap (seconds)."""

    ttft_s: float
    gap_s: float

    @classmethod
    def of(cls, recs: list[RequestRecord]) -> Speed:
        ttft = [r.chunk_times[0] - r.send_s for r in recs]
        # from t2 on: the first gap carries no prefill of its own, but is measured with the rest
        gaps = [b - a for r in recs
                for a, b in zip(r.chunk_times[1:], r.chunk_times[2:], strict=False)]
        return cls(statistics.median(ttft), statistics.median(gaps))

    @staticmethod
    def mean(speeds: list[Speed]) -> Speed:
        return Speed(statistics.fmean(s.ttft_s for s in speeds),
                     statistics.fmean(s.gap_s for s in speeds))

    def drift(self, reference: Speed) -> tuple[float, float]:
        """(prefill, decode) time ratios of this canary to the reference (>1: slower now)."""
        return self.ttft_s / reference.ttft_s, self.gap_s / reference.gap_s


def run_canary(url: str, plan: CanaryPlan = CanaryPlan()) -> Speed:
    rng = np.random.default_rng(plan.seed)
    reqs = [Request(i, 0.0, _prompt(rng, plan.prompt), plan.tokens)
            for i in range(plan.requests)]
    return Speed.of(_run(url, reqs, concurrency=1))


def _prefill(c: PrefillCost, k: float) -> PrefillCost:
    return PrefillCost(c.a * k, c.b * k, c.c * k)


def _decode(c: DecodeCost, k: float) -> DecodeCost:
    return DecodeCost(c.a * k, c.b * k, c.c * k)


def _split(s: SplitCost, kp: float, kd: float) -> SplitCost:
    """Seconds on P's side (its CPU per request) by `kp`; D's steps, the router's and API
    servers' seconds per request and event (they run on D's core while P prefills), the
    handover and the gap jitter by `kd`. Ratios (`prefill_factor`, `p_busy_stretch`) stay."""
    rows = tuple((row[0], row[1], *(v * kd for v in row[2:])) for row in s.interference)
    return replace(
        s, router_request_s=s.router_request_s * kd, handover_a_s=s.handover_a_s * kd,
        handover_b_s=s.handover_b_s * kd, decode=_decode(s.decode, kd), cpu_p_s=s.cpu_p_s * kp,
        cpu_d_s=s.cpu_d_s * kd, arrive_s=s.arrive_s * kd, t1_s=s.t1_s * kd,
        join_s=s.join_s * kd, finish_s=s.finish_s * kd, interference=rows,
        gap_jitter_s=tuple((v * kd, w) for v, w in s.gap_jitter_s))


def scaled(profile: Profile, prefill: float, decode: float) -> Profile:
    """`profile` on a machine whose prefill runs `prefill` and decode `decode` times as long."""
    if not (prefill > 0 and decode > 0):
        raise ValueError(f"drift ratios must be positive, got {prefill}, {decode}")
    split = _split(profile.split, prefill, decode) if profile.split is not None else None
    return replace(profile, prefill=_prefill(profile.prefill, prefill),
                   decode=_decode(profile.decode, decode), split=split,
                   gap_jitter_s=tuple((v * decode, w) for v, w in profile.gap_jitter_s))
