"""`sim validate --prefix-caching` (sim.validate_cache): the measured cache figures, the
per-repeat streams, points judged by their own targets, and one row against a real worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest

from splitserve.bench.repeat import MultiturnOptions
from splitserve.bench.workload import ArrivalSpec, WorkloadSpec, build_stream
from splitserve.sim.calibration.drift import (
    Canary,
    Speed,
    StretchPlan,
    canary_requests,
    modelled_reference,
    scaled,
)
from splitserve.sim.calibration.interference import probe_stream
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import load_profile
from splitserve.sim.profile import _prompt
from splitserve.sim.validate import METRICS, Point, launched
from splitserve.sim.validate_cache import (
    CACHE_METRICS,
    cache_figures,
    compare_cached,
    measure_cached,
    pace_factor,
    repeat_seed,
    repeat_workload,
    simulate_repeat,
    with_lag,
)
from tests.sim.conftest import make_profile
from tests.support import cores

DEMO_PROFILE = Path(__file__).parents[2] / "splitserve/sim/profiles/demo-cpu-1core.json"
CACHE_PD = SimConfig(mode="disagg", p_policy="cache", d_policy="cache")
MULTITURN = WorkloadSpec(source="multiturn", arrival=ArrivalSpec(rate=2.0), seed=5, warmup=1,
                         multiturn=MultiturnOptions(sessions=3, turns=3, system_tokens=256,
                                                    user_tokens=64, output_tokens=8,
                                                    think_time_s=1.0))


def test_router_counts_give_the_hit_rate_over_the_successful_prompts() -> None:
    run = {"prefix_hit_rate": None, "reported_cached_tokens": 256,
           "requests": [{"input_len": 300, "error_cause": None},
                        {"input_len": 500, "error_cause": None},
                        {"input_len": 900, "error_cause": "timeout"}]}
    out = cache_figures(run)
    assert out["prefix_hit_rate"] == pytest.approx(256 / 800)
    assert out["computed_prompt_tokens"] == 800 - 256
    told = {"prefix_hit_rate": 0.5, "reported_cached_tokens": 1, "requests": []}
    assert cache_figures(told) == told  # the client's own counts stand


def test_hit_rate_is_judged_in_points_and_computed_tokens_at_5_percent() -> None:
    hit = Point(1.0, "prefix_hit_rate", (0.50, 0.52), 0.535)
    assert hit.error == pytest.approx(0.025) and hit.verdict() == "ok"
    assert Point(1.0, "prefix_hit_rate", (0.50, 0.50), 0.54).verdict() == "MISS"
    assert Point(1.0, "computed_prompt_tokens", (1000.0, 1000.0), 1060.0).verdict() == "MISS"
    assert Point(1.0, "p90_ttft_ms", (100.0, 100.0), 108.0).verdict() == "ok"
    assert "p90_ttft_ms" in METRICS


def test_repeats_get_their_own_seeds_and_a_multiturn_repeat_arrives_as_sent() -> None:
    spec = repeat_seed(MULTITURN, 2)
    assert spec.seed == 7 and repeat_seed(MULTITURN, 0) == MULTITURN
    plan = build_stream(spec)
    sent = [{"index": q.index, "send_s": 10.0 + 3.0 * q.index, "error_cause": None}
            for q in plan]
    wl = repeat_workload(spec, {"requests": sent}, 128)
    assert list(wl.arrivals) == [3.0 * i for i in range(len(plan))]
    assert wl.blocks is not None and len(wl.blocks) == len(plan)
    assert wl.block_tokens == 128


def test_every_repeat_is_simulated_on_its_own_stream() -> None:
    runs = [{"seed": 5 + k, "prefix_hit_rate": 0.5, "computed_prompt_tokens": 1000,
             "median_ttft_ms": 50.0, "p90_ttft_ms": 80.0} for k in range(2)]
    one = SimConfig(mode="chunked", n_workers=1)
    points = compare_cached(make_profile(), one, MULTITURN, (2.0,), {2.0: runs})
    metrics = [p.metric for p in points]
    assert metrics[:2] == list(CACHE_METRICS[:2])  # no router: no router counters
    assert {"median_ttft_ms", "p90_ttft_ms"} <= set(metrics)
    hit = next(p for p in points if p.metric == "prefix_hit_rate")
    assert 0.3 < hit.sim < 0.8  # turns after the first reuse the session's history


def test_the_adjusted_simulation_runs_at_the_measured_decode_pace() -> None:
    one = SimConfig(mode="chunked", n_workers=1)
    runs = [{"seed": 5 + k, "prefix_hit_rate": 0.5, "median_ttft_ms": 50.0} for k in range(2)]
    raw = {p.metric: p for p in compare_cached(make_profile(), one, MULTITURN, (2.0,),
                                               {2.0: runs})}
    assert raw["median_ttft_ms"].sim_adjusted is None  # no measured ITL: nothing to pace to
    sims = [simulate_repeat(make_profile(), one, MULTITURN.with_rate(2.0), r, 128, None)
            for r in runs]
    itl = sum(s["median_itl_ms"] for s in sims) / len(sims)
    slow = [r | {"median_itl_ms": 3.0 * itl} for r in runs]  # measured 3x the simulated gaps
    assert pace_factor(slow, sims) == pytest.approx(3.0)
    paced = {p.metric: p for p in compare_cached(make_profile(), one, MULTITURN, (2.0,),
                                                 {2.0: slow})}
    adj = paced["median_itl_ms"].sim_adjusted
    assert adj is not None and adj > 2.0 * itl  # every step 3x as long (batches differ)
    ttft = paced["median_ttft_ms"]
    assert ttft.sim == raw["median_ttft_ms"].sim and ttft.sim_adjusted is not None
    assert ttft.sim_adjusted > 2.0 * ttft.sim  # every step is slower, prefill too


def test_with_canaries_each_repeat_is_simulated_at_its_own_drift() -> None:
    """Repeats whose canaries read prefill 2x and decode 1.5x the reference (one) and 1x (the
    other): each is simulated on the profile scaled by its own drift, and that drift wins over
    the ITL pace."""
    one = SimConfig(mode="chunked", n_workers=1)
    ref = Speed(0.1, 0.01)
    slow, same = Speed(0.2, 0.015).to_dict(), ref.to_dict()
    base = {"prefix_hit_rate": 0.5, "median_ttft_ms": 50.0, "median_itl_ms": 100.0}
    runs = [base | {"seed": 5, "canary": slow, "canary_after": slow},
            base | {"seed": 6, "canary": same, "canary_after": same}]
    got = {p.metric: p for p in compare_cached(make_profile(), one, MULTITURN, (2.0,),
                                               {2.0: runs}, reference=ref)}
    want = [simulate_repeat(prof, one, MULTITURN.with_rate(2.0), r, 128, None)
            for prof, r in zip((scaled(make_profile(), 2.0, 1.5), make_profile()), runs,
                               strict=True)]
    for m in ("median_ttft_ms", "median_itl_ms", "prefix_hit_rate"):
        assert got[m].sim_adjusted == pytest.approx((want[0][m] + want[1][m]) / 2), m
    assert got["median_ttft_ms"].sim_adjusted > got["median_ttft_ms"].sim


def test_reseeded_canaries_share_no_prompt_and_keep_their_shape() -> None:
    """No block of any canary's prompts (speed or stretch) recurs in another canary of a
    different k, nor between the speed and the stretch canary of any k; the lengths stay."""
    canary = Canary(stretch=StretchPlan(), decode=make_profile().decode)
    assert canary.reseeded(0) == canary
    blocks: dict[tuple[int, ...], tuple[int, str]] = {}
    for k in range(4):
        again = canary.reseeded(k)
        assert again.speed.prompt == canary.speed.prompt and again.stretch is not None
        assert again.stretch.prompt == canary.stretch.prompt
        speed = [q.prompt_token_ids for q in canary_requests(again.speed)]
        rng = np.random.default_rng(again.stretch.seed)  # as run_stretch_canary draws them
        stretch = [q.prompt_token_ids
                   for q in probe_stream(again.stretch.probe, 1, 8, partial(_prompt, rng))]
        assert [len(p) for p in speed] == [canary.speed.prompt] * canary.speed.requests
        assert [len(p) for p in stretch] == [canary.stretch.stream_prompt] + [
            canary.stretch.prompt] * canary.stretch.prefills
        for kind, prompts in (("speed", speed), ("stretch", stretch)):
            for prompt in prompts:
                first = prompt[:128]
                assert blocks.setdefault(first, (k, kind)) == (k, kind), (k, kind, blocks[first])


def cached_reported(url: str) -> float:
    """The router's count of prompt tokens its engines reported served from their caches."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve_router_cached_reported_tokens_total{"))


@pytest.fixture(scope="module")
def cache_pd() -> Iterator[str]:
    """splitserve's 1P1D of the demo model (P on one core, D and the router on the other),
    started as `sim validate --prefix-caching` starts it: caches on, cached-token counts in
    the answers, the router on `cache` policies."""
    with launched(CACHE_PD, cores.BOTH, 2048, router_cpus=cores.DECODE,
                  prefix_caching=True) as url:
        yield url


@pytest.mark.integration  # the launcher starts the workers (splitserve's own start_worker)
def test_simulated_hit_rate_is_within_3_points_of_a_real_1p1d(cache_pd: str) -> None:
    """One `sim validate --prefix-caching` row on a small multi-turn stream: the hit rate only
    (deterministic given the closed loop; timings are not asserted)."""
    real = measure_cached(cache_pd, MULTITURN, (2.0,), 1, canary=Canary())
    [run] = real[2.0]
    assert run["completed"] == 9 and run["reported_cached_tokens"] is not None
    assert Speed.from_dict(run["canary_after"]).ttft_s > 0
    # a canary at a fresh seed finds nothing cached; the same canary again finds its prompts
    cached = [cached_reported(cache_pd)]
    for k in (2, 2):
        Canary().reseeded(k).run(cache_pd)
        cached.append(cached_reported(cache_pd))
    assert cached[1] == cached[0] and cached[2] > cached[1], cached
    profile = load_profile(DEMO_PROFILE)
    points = compare_cached(profile, CACHE_PD, MULTITURN, (2.0,), real,
                            reference=modelled_reference(profile, CACHE_PD, Canary()))
    hit = next(p for p in points if p.metric == "prefix_hit_rate")
    assert hit.real_mean > 0.3, hit
    assert abs(hit.error) <= 0.03, hit
    assert all(p.sim_adjusted is not None for p in points)  # simulated at the canaries' drift


def test_each_repeat_is_simulated_at_the_index_lag_its_router_measured() -> None:
    run = {"index_lag_s": 0.02}
    assert with_lag(CACHE_PD, run, None).index_lag_s == 0.02
    assert with_lag(CACHE_PD, run, 0.5).index_lag_s == 0.5  # --index-lag-ms wins
    assert with_lag(CACHE_PD, {"index_lag_s": None}, None) is CACHE_PD  # not measured


def test_a_stored_cache_validation_with_canaries_simulates_again_at_their_drift(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--real-json` of a prefix-cache validation whose repeats ran between canaries (and no
    profiling, so no canary measured around one): the repeats drift against the canary
    simulated on the given profile, and the adjusted figures are those drifts' simulations."""
    from splitserve.cli import main
    from splitserve.sim.model import save_profile
    from splitserve.sim.validate import drift_json
    from splitserve.sim.validate_cache import seeds_json

    prof, one = make_profile(), SimConfig(mode="chunked", n_workers=1)
    ref = modelled_reference(prof, one, Canary())
    slow = Speed(ref.ttft_s * 1.5, ref.gap_s * 1.2).to_dict()
    runs = [{"seed": 5 + k, "prefix_hit_rate": 0.5, "median_ttft_ms": 50.0,
             "canary": slow, "canary_after": slow} for k in range(2)]
    stored = {"workload": MULTITURN.to_dict(), "repeats": 2, "seeds": seeds_json({2.0: runs}),
              "points": [p.to_dict() for p in compare_cached(prof, one, MULTITURN, (2.0,),
                                                             {2.0: runs})],
              "drift": drift_json(ref, {2.0: runs})}
    assert stored["drift"]["reference_measured"] is None
    (tmp_path / "old.json").write_text(json.dumps(stored))
    save_profile(prof, tmp_path / "p.json")
    out = tmp_path / "again.json"
    assert main(["sim", "validate", "--prefix-caching", "--profile", str(tmp_path / "p.json"),
                 "--mode", "chunked", "--workers", "1", "--cache-block-tokens", "128",
                 "--real-json", str(tmp_path / "old.json"), "--out", str(out)]) == 0
    assert "drift at 2/s (prefill / decode / P-busy stretch, per repeat): 1.500 / 1.200" in (
        capsys.readouterr().out)
    res = {p["metric"]: p for p in json.loads(out.read_text())["points"]}
    want = compare_cached(prof, one, MULTITURN, (2.0,), {2.0: runs}, reference=ref)
    for p in want:
        assert res[p.metric]["sim_adjusted"] == pytest.approx(p.sim_adjusted), p.metric
    assert res["median_ttft_ms"]["sim_adjusted"] > res["median_ttft_ms"]["sim"]
