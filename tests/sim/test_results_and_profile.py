"""Result keys and pooling, the workload adapter, and the profile file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec, build_stream
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile, ProfileMismatch, load_profile, save_profile
from splitserve.sim.results import itl_samples, summarize, weighted_percentiles
from splitserve.sim.run import simulate
from splitserve.sim.workload import arrays_from_spec
from tests.sim.conftest import make_profile


def test_weighted_percentiles_equal_expanded_numpy() -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(size=50)
    weights = rng.integers(0, 6, size=50)
    expanded = np.repeat(values, weights)
    got = weighted_percentiles(values, weights, (0.0, 12.5, 50.0, 99.0, 100.0))
    for p, v in got.items():
        assert v == pytest.approx(np.percentile(expanded, p))


def _spec(rate: float = 4.0, n: int = 300) -> WorkloadSpec:
    return WorkloadSpec(num_requests=n, input=LengthDist("uniform", 200, 50, 400),
                        output=LengthDist("uniform", 40, 2, 80),
                        arrival=ArrivalSpec("gamma", rate, burstiness=0.5), seed=5)


def test_adapter_draws_the_benchmarks_stream() -> None:
    spec = _spec()
    wl, reqs = arrays_from_spec(spec), build_stream(spec)
    assert wl.arrivals.tolist() == [r.arrival_s for r in reqs]
    assert wl.prompt_lens.tolist() == [r.input_len for r in reqs]
    assert wl.output_lens.tolist() == [r.output_len for r in reqs]


@pytest.mark.parametrize("mode", ["disagg", "colocated", "chunked"])
def test_every_token_gap_is_pooled_once(mode: str) -> None:
    wl = arrays_from_spec(_spec())
    o = simulate(make_profile(budget=256), SimConfig(mode, 1, 2, n_workers=2), wl)
    values, weights = itl_samples(o)
    assert weights.min() >= 0
    assert int(weights.sum()) == int((wl.output_lens - 1).sum())
    res = summarize(o)
    assert res["completed"] == len(wl) and res["failed"] == 0
    assert res["total_output_tokens"] == int(wl.output_lens.sum())
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                "median_tpot_ms", "p99_tpot_ms", "request_throughput"):
        assert res[key] is not None and res[key] > 0
    # a request's TPOT is the mean of its own gaps, so the pooled ITL mean lies in TPOT's range
    tpot = (o.finish - o.first_token) / (o.output_lens - 1)
    assert tpot.min() * 1000 <= res["mean_itl_ms"] <= tpot.max() * 1000


def test_profile_json_round_trips(tmp_path: Path) -> None:
    from dataclasses import replace

    prof = replace(make_profile(), gap_jitter_s=((-0.001, 500), (0.002, 500)))
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert json.loads(path.read_text())["model"]["kv_bytes_per_token"] == 2 * 8 * 2 * 64 * 4
    assert Profile.from_dict(json.loads(path.read_text())) == prof
    with pytest.raises(ValueError, match="gap_jitter_s"):
        replace(prof, gap_jitter_s=((float("nan"), 1000),))


def test_a_plain_workers_jitter_spreads_every_colocated_step_gap() -> None:
    from dataclasses import replace

    from splitserve.sim.workload import SimWorkload

    wl = SimWorkload.of([0.0, 0.3, 0.9], [200, 300, 100], [12, 12, 12])
    cfg = SimConfig("colocated", n_workers=1)
    flat = simulate(make_profile(), cfg, wl)
    noisy = simulate(replace(make_profile(), gap_jitter_s=((-0.001, 900), (0.005, 100))), cfg,
                     wl)
    v0, w0 = itl_samples(flat)
    v1, w1 = itl_samples(noisy)
    n = len(wl.output_lens)  # t1 -> t2 gaps come last and carry no jitter
    assert v1[:-n] == pytest.approx((v0[:-n, None] + [-0.001, 0.005]).ravel())
    assert w1[:-n].tolist() == (w0[:-n, None] * [900, 100]).ravel().tolist()
    fast = summarize(flat, system="a")["p99_itl_ms"]
    assert summarize(noisy, system="b")["p99_itl_ms"] == pytest.approx(fast + 5.0, rel=0.05)


def test_profile_from_another_engine_version_is_refused_or_flagged(tmp_path: Path) -> None:
    d = make_profile().to_dict() | {"kind": "measured"}
    d["engine"]["version"] = "0.31.0"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileMismatch, match="0.31.0"):
        load_profile(path, engine_version="0.32.0+cpu")
    flagged = load_profile(path, engine_version="0.32.0", accept_mismatch=True)
    assert flagged.mismatch is not None and "0.31.0" in flagged.mismatch
    assert load_profile(path, engine_version="0.31.0+cpu").mismatch is None


def test_profile_with_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps(make_profile().to_dict() | {"schema": "other/2"}))
    with pytest.raises(ValueError, match="schema"):
        load_profile(path)


def test_compressed_itl_pooling_keeps_mean_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    import splitserve.sim.results as results

    wl = arrays_from_spec(_spec(rate=8.0, n=400))
    o = simulate(make_profile(), SimConfig("disagg", 1, 1), wl)
    exact_v, exact_w = itl_samples(o)
    monkeypatch.setattr(results, "EXACT_STEPS", 0)
    comp_v, comp_w = itl_samples(o)
    assert len(comp_v) < len(exact_v)
    assert comp_w.sum() == exact_w.sum()
    assert (comp_v * comp_w).sum() == pytest.approx((exact_v * exact_w).sum(), rel=1e-12)
    bound = float((o.seg_beta * o.seg_k).max()) / (2 * results.BLOCKS)
    ex = weighted_percentiles(exact_v, exact_w)
    for p, v in weighted_percentiles(comp_v, comp_w).items():
        assert abs(v - ex[p]) <= bound + 1e-12


def test_transfer_links_from_a_benchmark_json(tmp_path: Path) -> None:
    from splitserve.sim.links import links_from_benchmark

    def rec(nbytes: float, bw: float, lat: float) -> dict[str, float]:
        return {"bytes": nbytes, "duration_s": nbytes / bw + lat, "gbps": bw / 1e9}

    doc = {"runs": [
        {"transport": "tcp", "transfers": [rec(n, 2e9, 3e-4) for n in (1e5, 1e6, 1e7)]},
        {"transport": "shm", "transfers": [rec(n, 8e9, 5e-5) for n in (1e5, 1e6, 1e7)]},
    ]}
    path = tmp_path / "kv_transfer.json"
    path.write_text(json.dumps(doc))
    links = links_from_benchmark(path)
    assert links["tcp"].bandwidth_Bps == pytest.approx(2e9)
    assert links["tcp"].latency_s == pytest.approx(3e-4)
    assert links["shm"].bandwidth_Bps == pytest.approx(8e9)
    assert links["shm"].time(4e6) == pytest.approx(4e6 / 8e9 + 5e-5)


@pytest.mark.parametrize("mode", ["disagg", "colocated", "chunked"])
def test_per_request_records_agree_with_the_pooled_metrics(mode: str) -> None:
    from splitserve.bench.metrics import compute_metrics
    from splitserve.sim.records import request_records

    wl = arrays_from_spec(_spec(n=200))
    o = simulate(make_profile(budget=256), SimConfig(mode, 1, 2, n_workers=2), wl)
    recs = request_records(o)
    for r, rec in enumerate(recs):
        assert len(rec.chunk_times) == wl.output_lens[r]
        assert rec.chunk_times[0] == o.first_token[r] and rec.chunk_times[-1] == o.finish[r]
        assert rec.chunk_times[1] == pytest.approx(o.second_token[r])
    bench = compute_metrics(recs, float(np.nanmax(o.finish)))
    ours = summarize(o)
    for key in ("median_itl_ms", "p99_itl_ms", "mean_itl_ms", "median_ttft_ms", "p99_tpot_ms",
                "max_itl_ms"):
        assert ours[key] == pytest.approx(bench[key], rel=1e-9)


def test_decode_window_counts_tokens_not_chunks() -> None:
    """Two requests decoding in lockstep at 10 ms a step; the second's server coalesced its
    tokens two per chunk. Both give 10 ms per step."""
    from splitserve.bench.client import RequestRecord
    from splitserve.sim.profile import decode_window

    def rec(times: list[float], tokens: list[int]) -> RequestRecord:
        return RequestRecord(index=0, kind="normal", input_len=100, requested_output_len=20,
                             scheduled_s=0.0, chunk_times=times, chunk_tokens=tokens)

    a = rec([0.1 + 0.01 * i for i in range(20)], [1] * 20)
    b = rec([0.1 + 0.01 * i for i in range(1, 20, 2)], [2] * 10)
    step, ctx = decode_window([a, b], 100)
    assert step == pytest.approx(0.01)
    assert ctx == pytest.approx(2 * (100 + 11))
