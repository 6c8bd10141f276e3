"""`splitserve sim validate --prefix-caching`: the simulator's prefix-cache model against real
workers that keep their prefix caches on.

Every repeat must start from caches that hold nothing of its own prompts, so no repeat replays
another's stream: repeat k of the command (counted over all rates and repeats) runs the
workload at seed `spec.seed + k` (`repeat_seed`). The seed fixes every token of the stream
(random prompts, multi-turn sessions, a Mooncake trace's block contents), so two repeats share
no prompt block, while their shapes (lengths, arrivals, a trace's hash structure) are drawn
alike. What a previous repeat left cached is then only evicted memory, never a hit. (Resetting
the workers' caches instead would need vLLM's `/reset_prefix_cache`, which vLLM serves only with
`VLLM_SERVER_DEV_MODE=1`, and splitserve's workers and launcher do not run it.)

Each repeat is simulated on its own stream: the same spec at its seed, except that a
`multiturn` repeat's arrivals are the times its closed loop actually sent each turn (the
records' `send_s`), since the simulator replays open-loop arrivals; its prompts' prefix
identity is the plan's (the placeholder answers have the real answers' lengths). The simulated
value of a metric is the mean over the repeats' simulations, compared with the mean of the
measured repeats (`validate.Point`; the spread is the measured min..max).

The adjusted simulation (`Point.sim_adjusted`) runs each repeat's stream on the profile scaled
by that repeat's drift, as `sim validate` without caches does (`calibration.drift`): canaries
run before the first repeat and after every repeat, each `Canary.reseeded` by its count so that
none finds an earlier one's prompts cached, and a repeat's drift is the mean of the canaries
around it over the same canary simulated on the profile (prefill from their TTFT, decode from
their gaps, D's P-busy stretch from the stretch canary of a disaggregated deployment). The
canaries are fixed probes, never the workload, so the adjusted hit rate, tokens computed, TTFT
and ITL remain predictions. Repeats measured without canaries are paced instead (`paced`): every
step slowed by one factor, the measured repeats' mean ITL p50 over their raw simulations'.

The measured cache figures (`cache_figures`): `prefix_hit_rate` and `computed_prompt_tokens`
as the client read them from the answers' `usage.prompt_tokens_details.cached_tokens` (a plain
worker started with `--enable-prompt-tokens-details`); behind splitserve's router, whose answers
do not carry the engines' usage, from the router's `reported_cached_tokens` (the cached tokens
the engine that computed each prompt reported: P's leg, or D's when the request ran whole on D)
over the successful requests' prompt tokens. The simulator's figures are the same quantity:
the prompt tokens each request's computing engine reused (`sim.results`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from splitserve.bench.client import ClientConfig
from splitserve.bench.runner import RunOptions, run_once
from splitserve.bench.workload import WorkloadSpec, build_stream
from splitserve.sim.calibration.drift import Canary, CanaryLog, Speed, scaled
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.validate import METRICS, Point, repeat_drifts
from splitserve.sim.workload import SimWorkload, arrays_from_spec, from_requests

# the cache figures compared (the router's counters only behind splitserve's router)
CACHE_METRICS = ("prefix_hit_rate", "computed_prompt_tokens", "local_prefills", "kv_bytes_moved")

Real = dict[float, list[dict[str, Any]]]  # rate → the measured repeats' result dicts


def repeat_seed(spec: WorkloadSpec, k: int) -> WorkloadSpec:
    """The stream of the command's k-th repeat (0-based over all rates): `spec` at seed
    `spec.seed + k`."""
    return replace(spec, seed=spec.seed + k)


def cache_figures(run: dict[str, Any]) -> dict[str, Any]:
    """`run` (a `run_once` result) with `prefix_hit_rate`, `cached_prompt_tokens` and
    `computed_prompt_tokens` filled from the router's `reported_cached_tokens` where the client
    saw no cached-token counts (see the module docstring); unchanged where it did or where
    neither is known."""
    if run.get("prefix_hit_rate") is not None or run.get("reported_cached_tokens") is None:
        return run
    prompt = sum(int(r["input_len"]) for r in run.get("requests") or []
                 if r.get("error_cause") is None)
    cached = int(run["reported_cached_tokens"])
    return run | {"cached_prompt_tokens": cached, "computed_prompt_tokens": prompt - cached,
                  "prefix_hit_rate": cached / prompt if prompt else None}


def measure_cached(url: str, spec: WorkloadSpec, rates: tuple[float, ...], repeats: int,
                   first: int = 0, api_key: str | None = None, canary: Canary | None = None
                   ) -> Real:
    """Per rate, `repeats` benchmark runs of `spec` at that rate, each at its own seed
    (`repeat_seed`, counting from `first`), with `cache_figures`; each run's dict carries its
    `seed`. `api_key`: the endpoint's Bearer key, if it wants one. With `canary`, one canary
    before the first run and one after every run (each `Canary.reseeded` by its count, so
    none finds another's prompts cached); each run carries the canaries just before and just
    after it (`canary`, `canary_after`), as `validate.measure_point`'s do."""
    out: Real = {}
    log = CanaryLog(canary, url, fresh=True) if canary is not None else None
    k = first
    for rate in rates:
        runs = out.setdefault(rate, [])
        for i in range(repeats):
            run_spec = repeat_seed(spec.with_rate(rate), k)
            client = ClientConfig(url=url, run_tag=f"validate-cache-{rate:g}-r{i}",
                                  api_key=api_key)
            run = asyncio.run(run_once(client, run_spec, "real", {"url": url}, {},
                                       RunOptions()))
            runs.append(cache_figures(run) | {"seed": run_spec.seed})
            if log is not None:
                log.after(runs[-1])
            k += 1
    return out


def repeat_workload(spec: WorkloadSpec, run: dict[str, Any], block_tokens: int) -> SimWorkload:
    """The stream repeat `run` sent (`spec` at the repeat's rate and seed), as the simulator
    replays it: `arrays_from_spec`, except that a `multiturn` repeat with its per-request
    records arrives when each turn was sent (records without a send time, turns never sent,
    keep the plan's offset from the first send)."""
    records = run.get("requests") or []
    if spec.source != "multiturn" or not records:
        return arrays_from_spec(spec, block_tokens)
    plan = build_stream(spec)
    sent = {int(r["index"]): float(r["send_s"]) for r in records
            if r.get("error_cause") != "session"}
    if not sent:
        return arrays_from_spec(spec, block_tokens)
    t0 = min(sent.values())
    first = min(q.arrival_s for q in plan)
    return from_requests([replace(q, arrival_s=sent[q.index] - t0 if q.index in sent
                                  else q.arrival_s - first) for q in plan], block_tokens)


def with_lag(cfg: SimConfig, run: dict[str, Any], index_lag_s: float | None) -> SimConfig:
    """`cfg` with the index lag a repeat is simulated at (see `compare_cached`)."""
    if index_lag_s is None:
        index_lag_s = run.get("index_lag_s")
    return cfg if index_lag_s is None else replace(cfg, index_lag_s=float(index_lag_s))


def compare_cached(profile: Profile, cfg: SimConfig, spec: WorkloadSpec,
                   rates: tuple[float, ...], real: Real, block_tokens: int = 128,
                   index_lag_s: float | None = None, reference: Speed | None = None
                   ) -> list[Point]:
    """Per rate, every metric (`CACHE_METRICS` first, then `validate.METRICS`): the measured
    repeats against the mean of each repeat's own simulation (its `seed`; see the module
    docstring), and against the mean of its adjusted simulation: at its canaries' drift over
    `reference` where every repeat has canaries (`validate.repeat_drifts`), else on the
    profile paced to the measured ITL (`paced`). `index_lag_s`: the router index's lag each
    simulation runs with; None: each repeat's as the router measured it (`index_lag_s` of its
    run, else `cfg`'s)."""
    points = []
    for rate in rates:
        runs = real[rate]
        rate_spec = spec.with_rate(rate)
        sims = [simulate_repeat(profile, cfg, rate_spec, run, block_tokens, index_lag_s)
                for run in runs]
        adjusted = [simulate_repeat(prof, cfg, rate_spec, run, block_tokens, index_lag_s)
                    for prof, run in zip(adjusted_profiles(profile, runs, sims, reference),
                                         runs, strict=False)]
        for m in CACHE_METRICS + METRICS:
            vals = tuple(float(r[m]) for r in runs if r.get(m) is not None)
            simmed = [float(s[m]) for s in sims if s.get(m) is not None]
            adj = [float(s[m]) for s in adjusted if s.get(m) is not None]
            if vals and simmed:
                points.append(Point(rate, m, vals, sum(simmed) / len(simmed),
                                    sum(adj) / len(adj) if adj else None))
    return points


def simulate_repeat(profile: Profile, cfg: SimConfig, spec: WorkloadSpec, run: dict[str, Any],
                    block_tokens: int, index_lag_s: float | None) -> dict[str, Any]:
    """A measured repeat's own stream (its seed) simulated on `profile`."""
    return summarize(simulate(profile, with_lag(cfg, run, index_lag_s), repeat_workload(
        replace(spec, seed=int(run["seed"])), run, block_tokens)), system="sim")


def adjusted_profiles(profile: Profile, runs: list[dict[str, Any]], sims: list[dict[str, Any]],
                      reference: Speed | None) -> list[Profile]:
    """Each repeat's adjusted profile: `profile` at its canaries' drift where every repeat has
    canaries, else paced to the measured ITL (`paced`) for all; none without either."""
    drifts = repeat_drifts(runs, reference)
    if drifts:
        return [scaled(profile, d.prefill, d.decode, d.stretch) for d in drifts]
    slowed = paced(profile, runs, sims)
    return [] if slowed is None else [slowed] * len(runs)


def pace_factor(runs: list[dict[str, Any]], sims: list[dict[str, Any]]) -> float | None:
    """The measured repeats' mean ITL p50 over their simulations' (None: either has none)."""
    real = [float(r["median_itl_ms"]) for r in runs if r.get("median_itl_ms")]
    simmed = [float(s["median_itl_ms"]) for s in sims if s.get("median_itl_ms")]
    if not real or not simmed:
        return None
    return (sum(real) / len(real)) / (sum(simmed) / len(simmed))


def paced(profile: Profile, runs: list[dict[str, Any]], sims: list[dict[str, Any]]
          ) -> Profile | None:
    """`profile` with every step (prefill and decode) `pace_factor` times as long."""
    f = pace_factor(runs, sims)
    return scaled(profile, f, f) if f is not None and f > 0 else None


def seeds_json(real: Real) -> dict[str, list[int]]:
    """The validation JSON's `seeds`: each rate's repeats' seeds, in order."""
    return {f"{r:g}": [int(run["seed"]) for run in runs] for r, runs in real.items()}


def attach_seeds(real: Real, seeds: dict[str, list[int]]) -> None:
    """Give `validate.stored_real`'s repeats back their seeds from a JSON's `seeds`."""
    for rate, runs in real.items():
        for run, seed in zip(runs, seeds[f"{rate:g}"], strict=True):
            run["seed"] = seed
