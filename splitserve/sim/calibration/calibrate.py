"""Measure what a disaggregated deployment costs beyond its workers' plain step times
(`model.SplitCost`), through a running deployment's router, with probes that are not any
validation workload:

1. **Lone requests** (one at a time, a grid of prompt lengths, a few output tokens): TTFT is
   fitted to `router_request_s + prefill_factor · base_prefill(l)` (the router's time per
   request, and P's slowdown while its connector pushes KV); the gap t1 → t2 at the client,
   less D's first step, to `handover_a_s + handover_b_s · l`.
2. **Decode through the router** (B concurrent streams, the profile's decode probe): D's step
   cost as the client sees it, fitted like the plain profile's (`a + b·ctx + c·B`), plus each
   measured batch's level off that line (`DecodeCost.batch_levels`; `levels=False` leaves
   them out): D's core is shared with the router, the client and the API servers, and its
   step is not linear in B (on the demo deployment B = 2 runs above B = 3–4). P prefills
   the B prompts one after the other, so each stream asks for enough tokens that all B still
   decode together after the last prefill (`decode_tokens` + the steps D takes meanwhile):
   otherwise the window "all B decoding" is empty and the row holds steps at smaller batches.
   Each gap there less its stream's local pace is the additive jitter (`gap_jitter_s`,
   `sim.jitter`).
3. **Interference** (`sim.interference`): background streams on D while single requests arrive
   one by one → D's slowdown while P prefills and the extra seconds of each request event
   (arrival, t1, join, end) on D's step, one row per background batch size.
4. **A loaded stream** (fixed lengths, evenly spaced at `load_rate`): how long t1 waits for the
   router's relay while D runs streams (`t1_relay_s`; the router and the client share D's
   core), found by bisection so that the simulator, with every other term above, reproduces
   this stream's measured median TTFT (`fit_loaded`). The term is a few per cent of TTFT, so
   a minute in which the machine is 10 % slower than during the lone requests would triple
   it: a speed canary just before and just
   after the stream reads that minute's drift against the canary simulated on the other terms
   (`drift.modelled_reference`), and the term is fitted on the profile scaled by it. The
   stream's median ITL is kept next to the simulated one (`load.sim_median_itl_s`, and at the
   minute's drift): how far the terms above miss a loaded stream minutes after they were
   measured.

The base profile's prefill times only enter as the shape of the prefill curve: the factor
absorbs any drift of the machine since the base was measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import Request
from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.calibration.drift import (
    Canary,
    CanaryPlan,
    Drift,
    Speed,
    canary_requests,
    modelled_reference,
    scaled,
)
from splitserve.sim.calibration.interference import (
    InterferencePlan,
    background_tokens,
    fit_interference,
    gap_rows,
    interference_rows,
    probe_stream,
)
from splitserve.sim.calibration.jitter import noise_bins, window_jitter
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.profile import (
    _prompt,
    _run,
    chunk_features,
    decode_window,
    fit_decode,
    nnls,
    robust_fit,
)
from splitserve.sim.records import timeline
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload


@dataclass(frozen=True)
class SplitPlan:
    """What to measure through the router."""

    lone_lens: tuple[int, ...] = (64, 256, 512, 1024)
    lone_repeats: int = 3
    lone_tokens: int = 12
    decode_batches: tuple[int, ...] = (1, 2, 3, 4, 8)  # each batch gets its level (below)
    decode_prompt_lens: tuple[int, ...] = (32, 256, 512)
    decode_tokens: int = 40
    decode_repeats: int = 2
    load_rate: float = 1.5
    load_requests: int = 30
    load_prompt: int = 300
    load_output: int = 48
    load_canaries: bool = True  # a speed canary (`CanaryPlan()`) just before and after it
    interference: InterferencePlan = InterferencePlan()
    max_model_len: int = 4096
    seed: int = 11

    def __post_init__(self) -> None:
        if len(self.lone_lens) < 2 or min(self.lone_lens) < 1:
            raise ValueError("need at least 2 positive lone prompt lengths")
        if self.lone_repeats < 1 or self.lone_tokens < 3:
            raise ValueError("lone_repeats >= 1 and lone_tokens >= 3 (t2 and a decode gap)")
        if len(self.decode_batches) * len(self.decode_prompt_lens) < 3:
            raise ValueError("need at least 3 (batch, prompt) decode points")
        if not (self.load_rate > 0 and self.load_requests >= 5 and self.load_prompt >= 1
                and self.load_output >= 3):
            raise ValueError("load_rate > 0, load_requests >= 5, load_output >= 3")


def base_prefill(profile: Profile, length: int) -> float:
    """The plain worker's time to prefill one lone prompt of `length` tokens."""
    chunks, tokens, quad = chunk_features(length, profile.token_budget)
    pf = profile.prefill
    return pf.a * chunks + pf.b * tokens + pf.c * quad


def measure_lone(url: str, plan: SplitPlan) -> list[tuple[int, float, float]]:
    """(prompt length, TTFT, t2 − t1) per lone request."""
    rng = np.random.default_rng(plan.seed)
    lens = [n for n in plan.lone_lens for _ in range(plan.lone_repeats)]
    reqs = [Request(i, 0.0, _prompt(rng, n), plan.lone_tokens) for i, n in enumerate(lens)]
    recs = _run(url, reqs, concurrency=1)
    return [(n, r.chunk_times[0] - r.send_s, r.chunk_times[1] - r.chunk_times[0])
            for n, r in zip(lens, recs, strict=True)]


def decode_tokens(base: Profile, plan: SplitPlan, batch: int, prompt: int) -> int:
    """Tokens per stream so that `batch` streams all decode together for `decode_tokens` steps
    after P has prefilled their prompts one by one (1.5× margin on P's and D's base pace)."""
    wait = 1.5 * batch * (base_prefill(base, prompt) + 0.01)
    step = base.decode.time(batch, batch * prompt)
    return min(plan.decode_tokens + int(wait / step) + 1, plan.max_model_len - prompt - 1)


def after_handovers(recs: list[RequestRecord]) -> float:
    """When the window of D's plain steps begins: past every stream's third chunk (t3), that
    is past the last joiner's t1 (on the step in progress), its join step and the step after
    it that relays its t2 — steps the event terms price, so the decode fit does not."""
    return max(r.chunk_times[min(2, len(r.chunk_times) - 1)] for r in recs)


def measure_decode_split(url: str, plan: SplitPlan, base: Profile
                         ) -> tuple[list[tuple[int, float, float]], list[float]]:
    """(batch, context, step seconds) rows through the router, and the gaps' jitter (s)."""
    rng = np.random.default_rng(plan.seed + 1)
    rows, jitter = [], []
    for L in plan.decode_prompt_lens:
        for b in plan.decode_batches:
            n = decode_tokens(base, plan, b, L)
            for _ in range(plan.decode_repeats):
                reqs = [Request(i, 0.0, _prompt(rng, L), n) for i in range(b)]
                recs = _run(url, reqs, concurrency=None)
                got = decode_window(recs, L, after_handovers(recs))
                if got is not None:
                    rows.append((b, got[1], got[0]))
                jitter += window_jitter(recs)
    return rows, jitter


def measure_interference(url: str, plan: SplitPlan, decode: DecodeCost
                         ) -> dict[int, list[RequestRecord]]:
    """The interference probe's records (`sim.interference`), per background batch; `decode`
    sizes the background streams."""
    ip = plan.interference
    rng = np.random.default_rng(plan.seed + 3)
    out = {}
    for bg in ip.bg_batches:
        bg_tokens = background_tokens(ip, bg, decode, plan.max_model_len)
        reqs = probe_stream(ip, bg, bg_tokens, lambda n: _prompt(rng, n))
        out[bg] = _run(url, reqs, concurrency=None)
    return out


def fit_lone(base: Profile, points: list[tuple[int, float, float]], decode: DecodeCost,
             join_s: float = 0.0) -> tuple[float, float, float, float, dict[str, Any]]:
    """(router_request_s, prefill_factor, handover_a_s, handover_b_s, quality). The handover
    is t2 − t1 less D's first step, which carries the join's `join_s`."""
    x = np.array([[1.0, base_prefill(base, n)] for n, _, _ in points])
    coef, quality = robust_fit(x, np.array([t for _, t, _ in points]))
    if coef[1] <= 0:  # the prefill must scale with something; fall back to the ratio
        coef = np.array([0.0, float(np.median([t / base_prefill(base, n)
                                               for n, t, _ in points]))])
    hand = np.array([h - decode.time(1, n + 1) - join_s for n, _, h in points])
    hx = np.array([[1.0, float(n)] for n, _, _ in points])
    hcoef = nnls(hx, hand, relative=False)
    quality["handover_residual_ms"] = float(np.median(np.abs(hx @ hcoef - hand)) * 1e3)
    return float(coef[0]), float(coef[1]), float(hcoef[0]), float(hcoef[1]), quality


def load_stream(plan: SplitPlan, decode: DecodeCost | None = None) -> list[Request]:
    """The loaded stream; with `decode` (D's step through the router), each request asks for
    at least enough tokens to decode for 1.5 arrival intervals, so that every t1 meets a busy
    D (what `t1_relay_s` is fitted on; at the demo's ~16 ms steps: 60 tokens)."""
    tokens = plan.load_output
    if decode is not None:
        step = decode.time(2, 2 * (plan.load_prompt + plan.load_output))
        tokens = max(tokens, math.ceil(1.5 / plan.load_rate / step))
    tokens = min(tokens, plan.max_model_len - plan.load_prompt - 1)
    rng = np.random.default_rng(plan.seed + 2)
    return [Request(i, i / plan.load_rate, _prompt(rng, plan.load_prompt), tokens)
            for i in range(plan.load_requests)]


def stream_medians(recs: list[RequestRecord]) -> tuple[float, float]:
    """(median TTFT, median pooled inter-chunk gap) in seconds, as the benchmark pools them."""
    ttft = [r.chunk_times[0] - r.send_s for r in recs]
    gaps = [b - a for r in recs for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return statistics.median(ttft), statistics.median(gaps)


def _bisect(f: Callable[[float], float], target: float, hi: float, iters: int = 30) -> float:
    """The smallest x in [0, hi] with f(x) >= target, for increasing f (0 when f(0) >= it)."""
    lo = 0.0
    if f(lo) >= target:
        return 0.0
    if f(hi) < target:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


T1_RELAY_MAX_S = 0.25  # the bisection's upper end for `t1_relay_s`


def fit_loaded(profile: Profile, cfg: SimConfig, wl: SimWorkload, ttft: float) -> float:
    """The `t1_relay_s` that makes the simulated median TTFT of `wl` the measured one, every
    other split term held fixed: t1 waits that long for the router's relay while the request's
    D runs streams. With the router and the client on D's core, a loaded stream's TTFT sits
    5–10 % above a lone request's at the same minute, and that excess hardly grows with the
    rate (measured TTFT p50 2 req/s over 1 req/s: 1.21–1.36×), where a mean-field stretch of
    every P step grew it to 1.47–1.53×.

    D's side has no such term: the router's, the client's and the API servers' work on D's core
    is in the decode fit (per token) and the event terms (per request event); a share fitted to
    the stream's median ITL on top of them absorbed that minute's drift and grew with the rate
    (the simulated ITL p50 at 2 req/s +31 %)."""
    split = profile.split
    assert split is not None

    def median_ttft(x: float) -> float:
        prof = replace(profile, split=replace(split, t1_relay_s=x))
        return float(summarize(simulate(prof, cfg, wl), system="calibrate")["median_ttft_ms"]) / 1e3

    if median_ttft(T1_RELAY_MAX_S) - median_ttft(0.0) < 1e-6:  # the stream cannot show it:
        return 0.0  # no t1 meets a busy D (its requests end before the next one's t1)
    return _bisect(median_ttft, ttft, T1_RELAY_MAX_S)


@dataclass(frozen=True)
class SplitMeasurements:
    """What `calibrate_split` measures through a router, all that `split_costs` fits; a
    calibrated profile keeps it in `split.fit` (`from_fit` reads it back)."""

    lone: list[tuple[int, float, float]]  # (prompt, TTFT, t2 − t1) per lone request
    decode_points: list[tuple[int, float, float]]  # (batch, context, step s) per window
    jitter_s: list[float]  # the decode windows' gaps less their stream's local pace
    probes: dict[int, list[RequestRecord]]  # the interference probe's records by background
    load: list[RequestRecord]  # the loaded stream's records
    measured: str  # when (ISO 8601, UTC)
    load_canaries: tuple[Speed, ...] = ()  # the speed canaries just before and after it

    @classmethod
    def from_fit(cls, fit: dict[str, Any]) -> SplitMeasurements:
        """Raises ValueError when `fit` keeps no probe records (not written by `split_costs`)."""
        load, probes = fit.get("load", {}), fit.get("interference", {})
        if "records" not in load or any("records" not in q for q in probes.values()):
            raise ValueError("this split profile keeps no probe records; calibrate it again")
        return cls([(int(n), float(a), float(b)) for n, a, b in fit["lone_points"]],
                   [(int(b), float(c), float(s)) for b, c, s in fit["decode_points"]],
                   [j / 1e3 for j in fit["jitter_ms"]],
                   {int(bg): _records(q["records"]) for bg, q in probes.items()},
                   _records(load["records"]), str(fit.get("measured", "")),
                   tuple(Speed.from_dict(c) for c in load.get("canaries", ())))


def _records(dicts: list[dict[str, Any]]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in dicts]


def _default_config(base: Profile) -> SimConfig:
    return SimConfig("disagg", 1, 1, transport="tcp" if "tcp" in base.transfer
                     else sorted(base.transfer)[0])


def calibrate_split(url: str, base: Profile, plan: SplitPlan, cfg: SimConfig | None = None,
                    say: Callable[[str], None] = print) -> Profile:
    """`base` with the `split` costs of the deployment behind `url` (a router)."""
    say("calibrate: lone requests through the router")
    lone = measure_lone(url, plan)
    say("calibrate: decode steps through the router")
    dec_points, jitter = measure_decode_split(url, plan, base)
    say("calibrate: interference on D (background streams, requests arriving one by one)")
    decode = fit_decode(dec_points, levels=True)[0]
    probes = measure_interference(url, plan, decode)
    say(f"calibrate: loaded stream, {plan.load_requests} requests at {plan.load_rate:g}/s")
    canaries = []
    if plan.load_canaries:
        canaries.append(Speed.of(_run(url, canary_requests(CanaryPlan()), concurrency=1)))
    load = _run(url, load_stream(plan, decode), concurrency=None)
    if plan.load_canaries:
        canaries.append(Speed.of(_run(url, canary_requests(CanaryPlan()), concurrency=1)))
    m = SplitMeasurements(lone, dec_points, jitter, probes, load,
                          datetime.now(UTC).isoformat(timespec="seconds"), tuple(canaries))
    return split_costs(base, m, cfg or _default_config(base), f"calibrated through {url}")


def refit_split(profile: Profile, cfg: SimConfig | None = None) -> Profile:
    """A calibrated profile's split costs fitted again from the measurements it keeps (after a
    change to a fit), on its own base part."""
    if profile.split is None:
        raise ValueError("the profile has no split costs to refit")
    base = replace(profile, split=None)
    m = SplitMeasurements.from_fit(profile.split.fit)
    prof = split_costs(base, m, cfg or _default_config(base), profile.split.source)
    assert prof.split is not None
    return replace(prof, split=replace(prof.split, fit=prof.split.fit | {
        "refitted": datetime.now(UTC).isoformat(timespec="seconds")}))


def split_costs(base: Profile, m: SplitMeasurements, cfg: SimConfig, source: str,
                levels: bool = True) -> Profile:
    """`base` with the split costs fitted from `m`: D's decode through the router, the
    interference rows (the first in the scalars), the lone fit against D's first row, the
    `t1_relay_s` fitted to the loaded stream's median TTFT (`fit_loaded`), and what
    the profile keeps; `levels`: D's decode with each measured batch's level (`fit_decode`)."""
    decode, qd = fit_decode(m.decode_points, levels=levels)
    fits, qi = [], {}
    for bg, recs in sorted(m.probes.items()):
        kappa, cost, q = fit_interference(gap_rows(recs, bg, decode))
        fits.append((bg, kappa, cost))
        qi[str(bg)] = q | {"bg_tokens": recs[0].requested_output_len, "records": timeline(recs)}
    rows = interference_rows(fits)
    kappa, *ev = rows[0][1:]  # the scalars hold the first row (SplitCost.interference)
    r0, factor, ha, hb, ql = fit_lone(base, m.lone, decode, rows[0][4])  # lone: D's first row
    ttft, itl = stream_medians(m.load)
    split = SplitCost(r0, factor, ha, hb, decode, p_busy_stretch=kappa, arrive_s=ev[0],
                      t1_s=ev[1], join_s=ev[2], finish_s=ev[3], t2_s=ev[4],
                      interference=rows, gap_jitter_s=noise_bins(m.jitter_s), source=source)
    wl = SimWorkload.of([r.scheduled_s for r in m.load], [r.input_len for r in m.load],
                        [r.requested_output_len for r in m.load])
    cfg = replace(cfg, mode="disagg", split_costs=True)
    drift = Drift()  # the loaded stream's minute against the terms above
    if m.load_canaries:
        drift = Speed.mean(list(m.load_canaries)).drift(
            modelled_reference(replace(base, split=split), cfg, Canary()))
    at = scaled(replace(base, split=split), drift.prefill, drift.decode)
    # fitted at the minute's speed, which scaled() applied to t1_relay_s by the decode ratio
    split = replace(split, t1_relay_s=fit_loaded(at, cfg, wl, ttft) / drift.decode)

    def sim_itl(prof: Profile) -> float:
        return float(summarize(simulate(prof, cfg, wl), system="calibrate")["median_itl_ms"]) / 1e3

    final = replace(base, split=split)
    first = m.load[0]
    fit = {"lone_points": [list(p) for p in m.lone], "lone_fit": ql,
           "decode_points": [list(p) for p in m.decode_points], "decode_fit": qd,
           "interference": qi,
           "jitter_ms": [round(j * 1e3, 3) for j in m.jitter_s],  # behind gap_jitter_s
           "load": {"rate": wl.offered_rate,
                    "requests": len(m.load), "prompt": first.input_len,
                    "output": first.requested_output_len, "median_ttft_s": ttft,
                    "median_itl_s": itl, "sim_median_itl_s": sim_itl(final),
                    "sim_median_itl_s_at_drift": sim_itl(scaled(final, drift.prefill,
                                                                drift.decode)),
                    "canaries": [c.to_dict() for c in m.load_canaries],
                    "drift": {"prefill": drift.prefill, "decode": drift.decode},
                    "records": timeline(m.load)},
           "measured": m.measured}
    return replace(base, split=replace(split, fit=fit))
