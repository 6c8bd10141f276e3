"""`splitserve sim validate`: run one workload for real and in simulation, at each load level,
and report the error of every metric on its own (errors cannot cancel).

The real side is the benchmark's runner (`splitserve.bench.runner.run_once`) against a running
deployment (`--url`, e.g. one started by `splitserve serve`), or one this command starts and
stops itself: a single plain vLLM worker (`splitserve.worker.launch`), or any other deployment
through splitserve's launcher (`splitserve.launch.local.LocalDeployment`: router + workers).
Repeats and rates replay the same prompts, so the deployment must run with prefix caching off
(the workers this command starts do), or every repeat after the first measures cache hits, not
prefills. `--prefix-caching` validates the cache model instead (`validate_cache`: caches on, a
fresh seed's stream per repeat); its hit rate is judged in points (`ABSOLUTE`), and each metric
against its own target (`TARGETS`: hit rate 3 points, prompt tokens computed 5 %, else 10 %).
Each real point is measured `repeats` times; the spread (min..max over repeats) is reported
next to the error, and an error whose simulated value lies inside the measured min..max is
marked as noise rather than a miss. The simulation replays the identical request stream (same
spec, seed and rate).

Where the profile is taken in the same command (`--reprofile`, `--calibrate`), a small canary probe
(`sim.calibration.drift`) runs around the profiling, before every repeat and after the last — for a
disaggregated deployment the stretch canary too — and each repeat is also simulated on the profile
scaled by its own drift (prefill and decode speed, and D's P-busy stretch, read off the mean of the
canaries just before and just after it); that drift-adjusted error is reported next to the raw one
(the machine's drift between profiling and measuring is not the model's error). The stored JSON
keeps the canaries (`drift_json`), so `--real-json` simulates a measurement again without
re-measuring (`stored_real`). `--prefix-caching` runs the canaries around every repeat too, each
at a fresh seed, with no profiling: the drift is then read against the canary simulated on the
given profile (`validate_cache`).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from splitserve.bench.client import ClientConfig, RequestRecord
from splitserve.bench.runner import RunOptions, run_once
from splitserve.bench.workload import WorkloadSpec
from splitserve.common.procs import stop_group
from splitserve.sim.calibration.drift import (
    Canary,
    CanaryLog,
    Drift,
    Speed,
    scaled,
    workload_stretch,
)
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import arrays_from_spec

METRICS = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "median_tpot_ms", "p99_tpot_ms", "request_throughput")
# a metric's target: |error| at most this (relative, or absolute for ABSOLUTE's; default 10 %)
TARGETS = {"prefix_hit_rate": 0.03, "computed_prompt_tokens": 0.05}
ABSOLUTE = frozenset({"prefix_hit_rate"})  # fractions compared in points, not relative


@dataclass(frozen=True)
class Point:
    rate: float
    metric: str
    real: tuple[float, ...]  # one per repeat
    sim: float
    sim_adjusted: float | None = None  # mean over repeats of each repeat's drift-scaled sim

    @property
    def real_mean(self) -> float:
        return sum(self.real) / len(self.real)

    @property
    def absolute(self) -> bool:
        """Error and spread in the metric's own unit (a hit rate: points), not relative."""
        return self.metric in ABSOLUTE

    @property
    def target(self) -> float:
        return TARGETS.get(self.metric, 0.10)

    @property
    def error(self) -> float:
        """sim − real mean: relative to the real mean, or absolute (`absolute`)."""
        if self.absolute:
            return self.sim - self.real_mean
        return (self.sim - self.real_mean) / self.real_mean if self.real_mean else float("nan")

    @property
    def spread(self) -> float:
        """Half the min..max range over repeats, relative to the mean (`absolute`: as is)."""
        half = (max(self.real) - min(self.real)) / 2
        if self.absolute:
            return half
        m = self.real_mean
        return half / m if m else float("nan")

    @property
    def within_noise(self) -> bool:
        return min(self.real) <= self.sim <= max(self.real)

    @property
    def adjusted(self) -> Point | None:
        """The same point judged by its drift-adjusted simulation (None: no canary)."""
        if self.sim_adjusted is None:
            return None
        return Point(self.rate, self.metric, self.real, self.sim_adjusted)

    def verdict(self) -> str:
        if self.within_noise:
            return "noise"
        return "ok" if abs(self.error) <= self.target else "MISS"

    def to_dict(self) -> dict[str, Any]:
        adj = self.adjusted
        return {"rate": self.rate, "metric": self.metric, "real": list(self.real),
                "real_mean": self.real_mean, "sim": self.sim, "error": self.error,
                "spread": self.spread, "within_noise": self.within_noise,
                "absolute": self.absolute, "target": self.target,
                "sim_adjusted": self.sim_adjusted,
                "error_adjusted": adj.error if adj else None,
                "within_noise_adjusted": adj.within_noise if adj else None}


def simulate_point(profile: Profile, cfg: SimConfig, spec: WorkloadSpec) -> dict[str, Any]:
    return summarize(simulate(profile, cfg, arrays_from_spec(spec)), system="sim")


def measure_point(url: str, spec: WorkloadSpec, repeats: int, canary: Canary | None = None
                  ) -> list[dict[str, Any]]:
    """`repeats` benchmark runs of `spec`; with `canary`, one canary before every run and one
    after the last, so each run's dict carries the canary just before it (`canary`) and the
    one just after it (`canary_after`), as `Speed.to_dict()`s."""
    out = []
    log = CanaryLog(canary, url) if canary is not None else None
    for i in range(repeats):
        client = ClientConfig(url=url, run_tag=f"validate-{spec.arrival.rate:g}-r{i}")
        run = asyncio.run(run_once(client, spec, "real", {"url": url}, {}, RunOptions()))
        if log is not None:
            log.after(run)
        out.append(run)
    return out


def repeat_canary(run: dict[str, Any]) -> Speed:
    """The canary a repeat stands for: the mean of the ones just before and just after it
    (one canary, a minute's sample, is often not the minute of the repeat)."""
    return Speed.mean([Speed.from_dict(run["canary"]), Speed.from_dict(run["canary_after"])])


def repeat_drifts(runs: list[dict[str, Any]], reference: Speed | None) -> list[Drift] | None:
    """Each repeat's drift against the reference (`repeat_canary`); None unless every repeat
    carries a canary."""
    if reference is None or not runs or any(r.get("canary") is None for r in runs):
        return None
    return [repeat_canary(r).drift(reference) for r in runs]


def compare(profile: Profile, cfg: SimConfig, spec: WorkloadSpec, rates: tuple[float, ...],
            real: dict[float, list[dict[str, Any]]], reference: Speed | None = None
            ) -> list[Point]:
    points = []
    for rate in rates:
        run_spec = spec.with_rate(rate)
        sim = simulate_point(profile, cfg, run_spec)
        drifts = repeat_drifts(real[rate], reference)
        adjusted = [simulate_point(scaled(profile, d.prefill, d.decode, d.stretch), cfg,
                                   run_spec) for d in drifts] if drifts else []
        for m in METRICS:
            vals = tuple(float(r[m]) for r in real[rate] if r.get(m) is not None)
            if vals and sim.get(m) is not None:
                adj = [float(a[m]) for a in adjusted if a.get(m) is not None]
                points.append(Point(rate, m, vals, float(sim[m]),
                                    sum(adj) / len(adj) if adj else None))
    return points


def drift_json(reference: Speed | None, real: dict[float, list[dict[str, Any]]],
               around: Speed | None = None) -> dict[str, Any] | None:
    """The validation JSON's `drift`: the reference (the canary simulated on the profile),
    the canaries measured around the profiling (`reference_measured`), and each repeat's
    canaries before and after it, by rate."""
    if reference is None:
        return None
    return {"reference": reference.to_dict(), "reference_source": "simulated",
            "reference_measured": around.to_dict() if around is not None else None,
            "canaries": {f"{r:g}": [run.get("canary") for run in runs]
                         for r, runs in real.items()},
            "canaries_after": {f"{r:g}": [run.get("canary_after") for run in runs]
                               for r, runs in real.items()}}


def stored_real(stored: dict[str, Any]
                ) -> tuple[WorkloadSpec, dict[float, list[dict[str, Any]]], Speed | None]:
    """A validation JSON's measured stream, its per-repeat metrics (each run with its canaries
    where the JSON has them) and the canaries measured around its profiling (None: no
    canaries, or no profiling in that command): what `compare` needs to simulate it again,
    with the reference simulated anew (`drift.modelled_reference`)."""
    spec = WorkloadSpec.from_dict(stored["workload"])
    real: dict[float, list[dict[str, Any]]] = {}
    for p in stored["points"]:
        runs = real.setdefault(float(p["rate"]), [])
        for i, v in enumerate(p["real"]):
            while len(runs) <= i:
                runs.append({})
            runs[i][p["metric"]] = v
    reference = None
    if drift := stored.get("drift"):
        measured = drift.get("reference_measured")  # None: no profiling in that command
        reference = None if measured is None else Speed.from_dict(measured)
        for rate, canaries in drift["canaries"].items():
            for run, c in zip(real[float(rate)], canaries, strict=True):
                run["canary"] = c
        for rate, canaries in drift["canaries_after"].items():
            for run, c in zip(real[float(rate)], canaries, strict=True):
                run["canary_after"] = c
    return spec, real, reference


def attach_records(real: dict[float, list[dict[str, Any]]], runs: dict[str, Any]) -> None:
    """Give `stored_real`'s repeats their per-request records and the router index's measured
    lag (`index_lag_s`) from the `.runs.json` that `sim validate --out` writes beside its JSON
    (rate → repeats, as measured), where it holds the same repeats."""
    for rate, repeats in real.items():
        stored = runs.get(f"{rate:g}")
        if stored is not None and len(stored) == len(repeats):
            for run, measured in zip(repeats, stored, strict=True):
                run["requests"] = measured.get("requests")
                run["index_lag_s"] = measured.get("index_lag_s")


NO_CACHE_WORKER_ARGS = ("--no-enable-prefix-caching",)
CACHE_WORKER_ARGS = ("--enable-prompt-tokens-details",)  # vLLM's prefix caching is on by default


def worker_args(prefix_caching: bool) -> tuple[str, ...]:
    """The engines' flags: repeats of one stream run without prefix caching (else every repeat
    after the first would find its prompts cached and measure almost no prefill); a prefix-cache
    validation (`validate_cache`, a fresh stream per repeat) keeps it on and has every answer
    carry its cached-token count."""
    return CACHE_WORKER_ARGS if prefix_caching else NO_CACHE_WORKER_ARGS


@contextlib.contextmanager
def local_worker(model: str, cpus: tuple[int, ...] | None, token_budget: int,
                 log_path: str | None = None, prefix_caching: bool = False) -> Iterator[str]:
    """A plain vLLM worker (no connector) for the duration of the block; yields its URL.
    Its engine runs without prefix caching, or with it and the cached-token count in every
    answer (`prefix_caching`: `CACHE_WORKER_ARGS`)."""
    from splitserve.config import WorkerConfig
    from splitserve.worker.launch import free_port, start_worker, wait_healthy

    cfg = WorkerConfig(model=model, port=free_port(), cpus=cpus,
                       max_num_batched_tokens=token_budget,
                       extra_args=worker_args(prefix_caching))
    proc = start_worker(cfg, None, log_path=log_path)
    try:
        wait_healthy(cfg.url, proc)
        yield cfg.url
    finally:
        stop_group(proc, 60.0, sweep=True, reap_s=30.0)


@contextlib.contextmanager
def launched(cfg: SimConfig, cpus: tuple[int, ...] | None, token_budget: int,
             log_dir: str | None = None, router_cpus: tuple[int, ...] | None = None,
             prefix_caching: bool = False) -> Iterator[str]:
    """The deployment `cfg` describes, started by splitserve's launcher (router + workers), for
    the duration of the block; yields the router's URL. The router runs `cfg`'s policies (what
    is simulated is what runs). Without `prefix_caching` the engines keep no prefix cache; with
    it they keep theirs (`worker_args`) and the router takes `cfg`'s
    `local_prefill_max_tokens`, and the workers' cache reports only when `cfg.cache_aware`
    (cache-blind: none, as the benchmark's `blind` arms)."""
    from splitserve.launch.config import DeploymentConfig
    from splitserve.launch.local import LocalDeployment
    from splitserve.worker.launch import free_port

    split = cfg.mode == "disagg"
    dep = DeploymentConfig(prefill=cfg.n_prefill if split else 0,
                           decode=cfg.n_decode if split else 0,
                           colocated=0 if split else cfg.n_workers, transport=cfg.transport,
                           port=free_port(), max_num_batched_tokens=token_budget, cpus=cpus,
                           log_dir=log_dir, worker_args=worker_args(prefix_caching),
                           router_cpus=router_cpus)
    if split:
        dep = replace(dep, prefill_policy=cfg.p_policy, decode_policy=cfg.d_policy)
    if prefix_caching and split:
        dep = replace(dep, local_prefill_max_tokens=cfg.local_prefill_max_tokens,
                      kv_events=cfg.cache_aware)
    with LocalDeployment(dep) as deployment:
        yield deployment.url


def print_drifts(real: dict[float, list[dict[str, Any]]], reference: Speed | None,
                 decode: DecodeCost | None = None) -> None:
    """Each repeat's drift (prefill, decode, P-busy stretch ratios), one line per rate; with
    `decode` (D's calibrated step) and the repeats' per-request records, also the P-busy
    stretch factor each repeat met (`drift.workload_stretch`) next to its canary's."""
    for rate, runs in sorted(real.items()):
        drifts = repeat_drifts(runs, reference)
        if not drifts:
            continue
        print(f"drift at {rate:g}/s (prefill / decode / P-busy stretch, per repeat): "
              + ", ".join(f"{d.prefill:.3f} / {d.decode:.3f} / {d.stretch:.3f}"
                          for d in drifts))
        if decode is None or any(not r.get("requests") for r in runs):
            continue
        met = [workload_stretch([RequestRecord.from_dict(q) for q in r["requests"]], decode)
               for r in runs]
        print(f"P-busy stretch factor at {rate:g}/s, canary / met by the repeat: "
              + ", ".join(f"{_f(repeat_canary(r).stretch)} / {_f(m)}"
                          for r, m in zip(runs, met, strict=True)))


def handovers(times: list[list[float]]) -> tuple[list[float], list[float]]:
    """Each request's handover gap t2 − t1 (from its chunk times), as (D idle, D busy): busy
    where another request was decoding at its t1 (that request's t2 < t1 < its last chunk).
    At low load ITL p99 lies in these gaps (~40 handovers among ~2,500 gaps, all
    longer than D's steps), a busy one being the rest of D's step in progress plus the step
    that admits the request, each carrying its event's work."""
    idle: list[float] = []
    busy: list[float] = []
    for i, t in enumerate(times):
        if len(t) < 2:
            continue
        others = any(j != i and len(u) >= 2 and u[1] < t[0] < u[-1] for j, u in enumerate(times))
        (busy if others else idle).append(t[1] - t[0])
    return idle, busy


def print_handovers(profile: Profile, cfg: SimConfig, spec: WorkloadSpec,
                    real: dict[float, list[dict[str, Any]]]) -> None:
    """Per rate, the median handover (D idle / D busy) of each repeat next to the raw
    simulation's (`handovers`); nothing for runs without per-request records."""
    from splitserve.sim.records import request_records

    def med(x: list[float]) -> str:
        return f"{statistics.median(x) * 1e3:.1f}" if x else "–"

    for rate, runs in sorted(real.items()):
        if any(not r.get("requests") for r in runs):
            continue
        sim = simulate(profile, cfg, arrays_from_spec(spec.with_rate(rate)))
        i, b = handovers([r.chunk_times for r in request_records(sim)])
        met = [handovers([q["chunk_times"] for q in r["requests"]]) for r in runs]
        print(f"handover ms at {rate:g}/s, D idle / D busy: sim {med(i)} / {med(b)}; measured "
              + ", ".join(f"{med(mi)} / {med(mb)}" for mi, mb in met))


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _pct(x: float, points: bool, spread: bool = False) -> str:
    """An error (signed) or a spread (±): in points for an absolute metric, else in %."""
    if points:
        return f"±{x * 100:.1f} pt" if spread else f"{x * 100:+.1f} pt"
    return f"±{x:.1%}" if spread else f"{x:+.1%}"


def print_points(points: list[Point],
                 adjusted: str = "each repeat simulated at its canary's drift") -> None:
    """The comparison table; `adjusted` says what the adjusted columns' simulation is."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="simulated vs measured (error = (sim − real mean) / real mean; pt: sim − "
                    f"real mean in points; adjusted: {adjusted})")
    drift = any(p.adjusted is not None for p in points)
    cols = ["rate", "metric", "real mean", "real min..max", "spread", "sim", "error", "verdict"]
    for col in cols + (["sim adj", "error adj", "verdict adj"] if drift else []):
        t.add_column(col, justify="right")
    for p in points:
        row = [f"{p.rate:g}", p.metric, f"{p.real_mean:.3g}",
               f"{min(p.real):.3g}..{max(p.real):.3g}", _pct(p.spread, p.absolute, spread=True),
               f"{p.sim:.3g}", _pct(p.error, p.absolute), p.verdict()]
        adj = p.adjusted
        if drift:
            row += ([f"{adj.sim:.3g}", _pct(adj.error, adj.absolute), adj.verdict()] if adj
                    else ["–"] * 3)
        t.add_row(*row)
    Console(width=max(Console().width, 140)).print(t)
