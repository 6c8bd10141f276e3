"""The stretch canary (D's pace while P prefills over its pace while P idles), and the stored
drift that carries it through a validation JSON and back (`--real-json`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec
from splitserve.sim.calibration import drift
from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.calibration.drift import (
    Canary,
    CanaryPlan,
    Drift,
    Speed,
    StretchPlan,
    scaled,
    stretch_of,
    workload_stretch,
)
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile, save_profile
from splitserve.sim.records import request_records
from splitserve.sim.run import simulate
from splitserve.sim.validate import (
    METRICS,
    compare,
    drift_json,
    repeat_drifts,
    simulate_point,
    stored_real,
)
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

IDLE, BUSY = 0.010, 0.012  # the stream's gaps while P idles and while P prefills
PREFILLS = ((1.0, 1.3), (2.0, 2.3))  # (arrival, t1) of the long prompts: P's busy windows


def _rec(i: int, send: float, times: list[float], prompt: int = 100) -> RequestRecord:
    return RequestRecord(i, "normal", prompt, len(times), send, send_s=send, chunk_times=times)


def _stream(end: float) -> list[float]:
    """t1 at 0.05, then a gap of BUSY for each step that starts inside a prefill, else IDLE."""
    times, t = [0.05], 0.06
    while t < end:
        times.append(t)
        t += BUSY if any(a <= t < b for a, b in PREFILLS) else IDLE
    return times


def test_stretch_is_the_busy_over_idle_pace_of_the_streams_clean_gaps() -> None:
    recs = [_rec(0, 0.0, _stream(3.0))]
    recs += [_rec(i + 1, a, [b, b + 0.01, b + 0.02], 1024) for i, (a, b) in enumerate(PREFILLS)]
    # a flat step: each gap is read as it is; gaps holding an event or straddling a prefill's
    # edge are not clean, so exactly BUSY / IDLE
    assert stretch_of(recs, DecodeCost(IDLE, 0.0, 0.0)) == pytest.approx(BUSY / IDLE)
    # the step's level cancels: only its shape over batch and context matters
    assert stretch_of(recs, DecodeCost(0.5, 0.0, 0.0)) == pytest.approx(BUSY / IDLE)
    # no prefill during the stream: no stretch reading; a stream too short: none either
    assert stretch_of(recs[:1], DecodeCost(IDLE, 0.0, 0.0)) is None
    assert stretch_of([_rec(0, 0.0, [0.05, 0.06, 0.07, 0.08])], DecodeCost(IDLE, 0.0)) is None
    # a measured run's own records: every stream's clean gaps, every request's events
    two = [*recs, _rec(3, 0.0, [t + 0.003 for t in _stream(2.9)]), _rec(4, 0.5, [])]
    assert workload_stretch(two, DecodeCost(IDLE, 0.0, 0.0)) == pytest.approx(BUSY / IDLE)
    assert workload_stretch(recs[:1], DecodeCost(IDLE, 0.0, 0.0)) is None


DEC = DecodeCost(0.008, 1e-6, 5e-4)
SPLIT = SplitCost(router_request_s=0.0, prefill_factor=1.0, handover_a_s=0.02,
                  handover_b_s=0.0, decode=DEC)
PLAN = StretchPlan(prompt=300)  # ~0.33 s of prefill on the constructed profile


def _deployment(stretch: float) -> Profile:
    rows = ((1.0, stretch, 0.003, 0.004, 0.002, 0.001, 0.0),
            (4.0, stretch / 2, 0.0, 0.0, 0.0, 0.0, 0.0))
    return replace(make_profile(), split=replace(SPLIT, interference=rows))


def _simulated_run(truth: Profile) -> Callable[[str, list, int | None], list[RequestRecord]]:
    """`_run` answered by the simulator of the deployment `truth`."""
    def run(url: str, reqs: list, concurrency: int | None) -> list[RequestRecord]:
        def sim(rs: list) -> list[RequestRecord]:
            wl = SimWorkload.of([r.arrival_s for r in rs], [r.input_len for r in rs],
                                [r.output_len for r in rs])
            return request_records(simulate(truth, SimConfig("disagg"), wl))
        return [sim([r])[0] for r in reqs] if concurrency == 1 else sim(reqs)
    return run


@pytest.mark.parametrize("stretch", [0.0, 0.1, 0.25])
def test_the_canary_reads_the_deployments_stretch(stretch: float,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary's requests answered by the simulator of a deployment whose D steps take
    1 + stretch times as long while P prefills (with event seconds on top): it reads that
    factor back, and `Canary.run` carries it with the speed canary's readings."""
    monkeypatch.setattr(drift, "_run", _simulated_run(_deployment(stretch)))
    assert drift.run_stretch_canary("sim://", DEC, PLAN) == pytest.approx(1 + stretch, abs=1e-6)
    speed = Canary(CanaryPlan(), PLAN, DEC).run("sim://")
    assert speed.stretch == pytest.approx(1 + stretch, abs=1e-6) and speed.gap_s > 0
    assert Canary().run("sim://").stretch is None  # a plain worker's canary reads none
    with pytest.raises(ValueError):
        Canary(stretch=PLAN)  # the stretch canary reads gaps against a decode cost


def test_plan_is_small_and_checked() -> None:
    probe = StretchPlan().probe
    assert probe.bg_batches == (1,) and probe.inject_lens == (1024,)
    assert probe.duration_s <= 6.0  # it runs before every repeat
    with pytest.raises(ValueError):
        StretchPlan(prefills=2)


SPEC = WorkloadSpec(num_requests=30, input=LengthDist("uniform", 300, 100, 600),
                    output=LengthDist("fixed", 30), arrival=ArrivalSpec("poisson", 1.0))
CFG = SimConfig("disagg")


def _measured(prof: Profile, canaries: list[dict]) -> dict[float, list[dict]]:
    """Three repeats at 1 req/s, each measuring exactly what `prof` simulates, each with the
    same canary just before and just after it."""
    sim = simulate_point(prof, CFG, SPEC)
    return {1.0: [{**{m: sim[m] for m in METRICS}, "canary": c, "canary_after": c}
                  for c in canaries]}


def _stored(real: dict[float, list[dict]], reference: Speed | None) -> dict:
    """A validation JSON as `sim validate --out` writes it, through JSON text (`reference`
    stands for the canaries measured around the profiling too)."""
    points = compare(make_profile(), CFG, SPEC, (1.0,), real, reference)
    return json.loads(json.dumps({"workload": SPEC.to_dict(), "repeats": 3,
                                  "points": [p.to_dict() for p in points],
                                  "drift": drift_json(reference, real, reference)}))


def test_the_stored_drift_round_trips_with_the_stretch() -> None:
    prof = _deployment(0.1)
    ref = Speed(0.1, 0.01, 1.1)
    # the repeats ran with a stretch factor 1.32 / 1.1 = 1.2 times the calibration's
    truth = scaled(prof, 1.0, 1.0, 1.2)
    now = Speed(0.1, 0.01, 1.32)
    real = _measured(truth, [now.to_dict()] * 3)
    stored = _stored(real, ref)
    assert stored["drift"]["reference"] == {"ttft_s": 0.1, "gap_s": 0.01, "stretch": 1.1}
    spec, back, reference = stored_real(stored)
    assert spec == SPEC and reference == ref
    assert [Speed.from_dict(r["canary"]) for r in back[1.0]] == [now] * 3
    points = compare(prof, CFG, spec, (1.0,), back, reference)
    # the drift-adjusted simulation is the truth's; the raw one is not
    p99 = next(p for p in points if p.metric == "p99_itl_ms")
    assert p99.adjusted is not None and p99.adjusted.error == pytest.approx(0.0, abs=1e-9)
    assert all(p.adjusted is not None and p.adjusted.error == pytest.approx(0.0, abs=1e-9)
               for p in points)
    assert p99.error < -0.01


def test_a_repeat_stands_for_the_mean_of_its_canaries_before_and_after() -> None:
    """The canaries just before and just after a repeat bracket its minute: its drift is
    their mean's, through the stored JSON and back."""
    prof = _deployment(0.1)
    ref = Speed(0.1, 0.01, 1.1)
    before, after = Speed(0.11, 0.012, 1.0), Speed(0.13, 0.014, 1.2)  # mean: 1.2 / 1.3 / 1.0
    real = _measured(scaled(prof, 1.2, 1.3), [before.to_dict()] * 3)
    for run in real[1.0]:
        run["canary_after"] = after.to_dict()
    stored = _stored(real, ref)
    assert stored["drift"]["canaries_after"] == {"1": [after.to_dict()] * 3}
    _, back, reference = stored_real(stored)
    assert [r["canary_after"] for r in back[1.0]] == [after.to_dict()] * 3
    want = Drift(pytest.approx(1.2), pytest.approx(1.3), pytest.approx(1.0))
    assert repeat_drifts(back[1.0], reference) == [want] * 3
    points = compare(prof, CFG, SPEC, (1.0,), back, reference)
    assert all(p.adjusted is not None and p.adjusted.error == pytest.approx(0.0, abs=1e-9)
               for p in points)


def test_a_stored_speed_only_drift_simulates_again(tmp_path: Path) -> None:
    """Canaries without a stretch reading (too few clean gaps): `--real-json` reads them,
    drifts only speed, and keeps the stored measured reference."""
    from splitserve.cli import main

    prof = _deployment(0.1)
    speed = [{"ttft_s": 0.12, "gap_s": 0.013, "stretch": None}] * 3  # 20 % / 30 % slow
    stored = _stored(_measured(scaled(prof, 1.2, 1.3), speed), Speed(0.1, 0.01))
    _, real, reference = stored_real(stored)
    assert reference == Speed(0.1, 0.01) and reference.stretch is None
    points = compare(prof, CFG, SPEC, (1.0,), real, reference)
    assert all(p.adjusted is not None and p.adjusted.error == pytest.approx(0.0, abs=1e-9)
               for p in points)
    (tmp_path / "old.json").write_text(json.dumps(stored))
    save_profile(prof, tmp_path / "p.json")
    out = tmp_path / "again.json"
    assert main(["sim", "validate", "--profile", str(tmp_path / "p.json"), "--mode", "disagg",
                 "--real-json", str(tmp_path / "old.json"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    # the stored reference is kept as measured; the repeats drift against the profile's canary
    assert res["drift"]["reference_measured"] == {"ttft_s": 0.1, "gap_s": 0.01, "stretch": None}
    modelled = drift.modelled_reference(prof, CFG, Canary(stretch=StretchPlan(),
                                                          decode=prof.decode))
    assert res["drift"]["reference_source"] == "simulated"
    assert res["drift"]["reference"] == pytest.approx(modelled.to_dict())
    want = compare(prof, CFG, SPEC, (1.0,), real, modelled)
    assert [p["error_adjusted"] for p in res["points"]] == pytest.approx(
        [p.adjusted.error for p in want if p.adjusted is not None])


def test_real_json_reads_the_per_request_records_beside_it(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """With the `.runs.json` that `sim validate --out` writes beside its JSON, a re-simulation
    prints each repeat's handovers (and the stretch it met) next to the simulation's: here the
    repeats measured exactly what the profile simulates, so the numbers agree."""
    from splitserve.cli import main
    from splitserve.sim.workload import arrays_from_spec

    prof = _deployment(0.1)
    ref = Speed(0.1, 0.01, 1.1)
    stored = _stored(_measured(prof, [ref.to_dict()] * 3), ref)
    (tmp_path / "v.json").write_text(json.dumps(stored))
    recs = [r.to_dict() for r in request_records(simulate(prof, CFG, arrays_from_spec(SPEC)))]
    (tmp_path / "v.runs.json").write_text(json.dumps({"1": [{"requests": recs}] * 3}))
    save_profile(prof, tmp_path / "p.json")
    assert main(["sim", "validate", "--profile", str(tmp_path / "p.json"), "--mode", "disagg",
                 "--real-json", str(tmp_path / "v.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("handover ms at 1/s"))
    sim, measured = line.split(": sim ")[1].split("; measured ")
    assert measured.split(", ") == [sim] * 3
    assert "–" not in sim  # both kinds of handover occur at 1 req/s


@pytest.mark.parametrize("fresh", [False, True])
def test_a_canary_log_brackets_every_repeat(fresh: bool, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """One canary before the first repeat and one after each: a repeat carries the canaries
    just before and after it; fresh canaries draw new prompts each time, the others repeat."""
    answer = _simulated_run(_deployment(0.0))
    firsts: list[tuple[int, ...]] = []

    def run(url: str, reqs: list, concurrency: int | None) -> list[RequestRecord]:
        firsts.append(reqs[0].prompt_token_ids[:16])
        return answer(url, reqs, concurrency)

    monkeypatch.setattr(drift, "_run", run)
    log = drift.CanaryLog(Canary(), "sim://", fresh=fresh)
    runs: list[dict] = [{}, {}]
    for r in runs:
        log.after(r)
    assert len(log.speeds) == 3
    assert [r["canary"] for r in runs] == [s.to_dict() for s in log.speeds[:2]]
    assert [r["canary_after"] for r in runs] == [s.to_dict() for s in log.speeds[1:]]
    assert len(set(firsts)) == (3 if fresh else 1)
