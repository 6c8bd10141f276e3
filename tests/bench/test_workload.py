"""Request streams: requested rate and burstiness, seeds, interference mix, files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from splitserve.bench.workload import (
    INTERFERENCE,
    ArrivalSpec,
    LengthDist,
    WorkloadSpec,
    build_stream,
    build_warmup,
    stream_digest,
)

N = 20_000


def gaps(spec: ArrivalSpec, seed: int = 7) -> np.ndarray:
    return spec.gaps(np.random.default_rng(seed), N)


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_has_the_requested_rate(rate: float) -> None:
    g = gaps(ArrivalSpec("poisson", rate))
    # 20,000 exponential gaps: the mean is within 3 % of 1/rate (~4 standard errors).
    assert g.mean() == pytest.approx(1 / rate, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # CV of an exponential


@pytest.mark.parametrize("k", [0.25, 0.5, 4.0])
def test_gamma_burstiness_sets_the_variability(k: float) -> None:
    g = gaps(ArrivalSpec("gamma", 5.0, burstiness=k))
    assert g.mean() == pytest.approx(0.2, rel=0.04)
    # Gamma(k, 1/(rate k)): squared coefficient of variation is 1/k.
    assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / k, rel=0.1)


def test_burstier_streams_cluster_more() -> None:
    def window_var(k: float) -> float:
        t = np.cumsum(gaps(ArrivalSpec("gamma", 10.0, burstiness=k)))
        return float(np.histogram(t, bins=np.arange(0, t[-1], 1.0))[0].var())

    assert window_var(0.25) > 2 * window_var(1.0) > 2 * window_var(4.0)


def test_constant_closed_and_ramp() -> None:
    assert np.allclose(gaps(ArrivalSpec("constant", 4.0)), 0.25)
    assert not gaps(ArrivalSpec("closed", max_concurrency=3)).any()
    g = gaps(ArrivalSpec("ramp", 1.0, ramp_end_rate=9.0))
    # The rate climbs linearly 1 → 9: gaps in the first tenth are much longer than in the last.
    assert g[: N // 10].mean() > 3 * g[-N // 10:].mean()
    with pytest.raises(ValueError):
        ArrivalSpec("ramp", 1.0)
    with pytest.raises(ValueError):
        ArrivalSpec("closed")
    with pytest.raises(ValueError):
        ArrivalSpec("poisson", 0.0)


def test_stream_rate_and_lengths() -> None:
    spec = WorkloadSpec(num_requests=4000, input=LengthDist("uniform", 0, 100, 200),
                        output=LengthDist("normal", 50, 10, 90, std=10.0),
                        arrival=ArrivalSpec("poisson", 8.0), seed=3)
    reqs = build_stream(spec)
    assert len(reqs) == 4000
    assert len(reqs) / reqs[-1].arrival_s == pytest.approx(8.0, rel=0.05)
    assert all(100 <= r.input_len <= 200 for r in reqs)
    outs = np.array([r.output_len for r in reqs])
    assert outs.min() >= 10 and outs.max() <= 90 and outs.mean() == pytest.approx(50, abs=1)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_same_seed_same_stream_other_seed_other_stream() -> None:
    spec = WorkloadSpec(num_requests=50, input=LengthDist("uniform", 0, 10, 300), seed=11)
    a, b = build_stream(spec), build_stream(spec)
    assert a == b and stream_digest(a) == stream_digest(b)
    c = build_stream(WorkloadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))))
    assert c == a
    other = build_stream(WorkloadSpec(num_requests=50, input=spec.input, seed=12))
    assert stream_digest(other) != stream_digest(a)
    assert all(w.warmup for w in build_warmup(spec)) and len(build_warmup(spec)) == spec.warmup


def test_interference_mix() -> None:
    spec = WorkloadSpec(source="interference", seed=0)
    reqs = build_stream(spec)
    mix = INTERFERENCE
    longs = [r for r in reqs if r.kind == "long"]
    shorts = [r for r in reqs if r.kind == "short"]
    expected = [mix.long_period_s / 2 + i * mix.long_period_s
                for i in range(int(mix.duration_s / mix.long_period_s + 0.5))]
    assert [r.arrival_s for r in longs] == pytest.approx(expected)
    assert all(mix.long_input.low <= r.input_len <= mix.long_input.high for r in longs)
    assert all(mix.short_input.low <= r.input_len <= mix.short_input.high for r in shorts)
    assert all(r.arrival_s < mix.duration_s for r in reqs)
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert spec.with_rate(5.0).interference.short_rate == 5.0


def test_trace_replay_and_sharegpt(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_len,output_len\n10.5,30,4\n10.0,20,3\n12.0,40,5\n")
    reqs = build_stream(WorkloadSpec(source="trace", path=str(trace)))
    assert [(r.arrival_s, r.input_len, r.output_len) for r in reqs] == [
        (0.0, 20, 3), (0.5, 30, 4), (2.0, 40, 5)]
    share = tmp_path / "s.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "x" * 400},
                           {"from": "gpt", "value": "y" * 80}]},
        {"conversations": [{"from": "human", "value": "lonely"}]},
    ]))
    reqs = build_stream(WorkloadSpec(source="sharegpt", path=str(share), num_requests=5))
    assert [(r.input_len, r.output_len) for r in reqs] == [(100, 20)] * 5
    with pytest.raises(ValueError):
        WorkloadSpec(source="trace")
