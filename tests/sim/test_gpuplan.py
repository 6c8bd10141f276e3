"""`splitserve plan --gpus`: candidates over TP per pool, the search, the ladder's verdict, and
the commands it prints, on an analytic model small enough to plan in seconds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from splitserve.bench.metrics import SLO
from splitserve.cli import main
from splitserve.sim.analytic import PRESETS, ModelConfig, analytic_profile
from splitserve.sim.deployment import SimConfig
from splitserve.sim.gpuplan import (
    GpuCandidate,
    GpuPlanner,
    GpuPlanRequest,
    Rung,
    Shape,
    budgets,
    ladder,
    ladder_verdict,
    shapes,
)
from splitserve.sim.gpuplan_cli import deploy_commands, serve_dtype
from splitserve.sim.model import Profile
from splitserve.sim.workload import SimWorkload

# a Llama-3.1-8B-shaped model (public numbers)
L8 = ModelConfig("llama-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                 intermediate=14336, vocab=128256)
CONFIG = ('{"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, '
          '"num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}')


def test_every_candidate_fits_the_budget_and_d_takes_what_is_left() -> None:
    got = shapes(8, (1, 2, 4), ("cache",), "rdma")
    assert all(s.gpus <= 8 for s in got)
    co = [s for s in got if s.config.mode != "disagg"]
    assert [(s.config.n_workers, s.tp_p) for s in co] == [(8, 1), (4, 2), (2, 4)]
    pd = [(s.config.n_prefill, s.tp_p, s.config.n_decode, s.tp_d) for s in got
          if s.config.mode == "disagg"]
    assert (1, 4, 1, 4) in pd and (3, 2, 2, 1) in pd and (7, 1, 1, 1) in pd
    assert all(8 - (n_p * tp_p + n_d * tp_d) < tp_d for n_p, tp_p, n_d, tp_d in pd)
    assert all(s.config.p_policy == "load" for s in co)  # as the router routes a colocated pool
    both = shapes(8, (1, 2, 4), ("cache", "load"), "rdma")
    assert len(both) == len(co) + 2 * len(pd)
    assert budgets(16) == [1, 2, 4, 8, 16] and budgets(12) == [1, 2, 4, 8, 12]


def workload(n: int = 120, prompt: int = 3000, out: int = 100) -> SimWorkload:
    rng = np.random.default_rng(0)
    return SimWorkload(np.cumsum(rng.exponential(0.25, n)), np.full(n, prompt),
                       np.full(n, out))


def test_a_plan_searches_the_shortlist_and_prefers_what_meets_the_target() -> None:
    profiles = {tp: analytic_profile(L8, PRESETS["h100-sxm"], tp=tp) for tp in (1, 2)}
    planner = GpuPlanner(profiles, workload())
    req = GpuPlanRequest(4, 4.0, SLO(400, 40), shortlist=2, bisect_steps=3)
    plan = planner.plan(req)
    assert len(plan.candidates) == len(shapes(4, (1, 2), ("cache",), "rdma"))
    searched = [c for c in plan.candidates if c.searched]
    assert len(searched) == 4  # 2 colocated, 2 disaggregated
    assert plan.best.searched and plan.best.goodput is not None
    assert plan.best.attainment >= req.target or not any(
        c.attainment >= req.target for c in plan.candidates)
    assert plan.best_colocated is not None and plan.best_disagg is not None
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["best"]["gpus"] <= 4 and doc["verdict"].startswith(plan.best.shape.label)
    rungs = ladder(planner, req, plan)
    assert [r.gpus for r in rungs] == [1, 2, 4] and rungs[-1].disagg is plan.best_disagg
    assert rungs[0].disagg is None  # one GPU cannot split
    with pytest.raises(ValueError, match="tp=2"):
        GpuPlanner({1: profiles[2]}, workload())


def test_the_ladder_says_who_wins_where() -> None:
    co = Shape(SimConfig("chunked", n_workers=1), 1)
    pd = Shape(SimConfig("disagg", n_prefill=1, n_decode=1), 1)

    def cand(shape: Shape, gp: float | None) -> GpuCandidate:
        return GpuCandidate(shape, 0.9, gp, True)

    rungs = [Rung(1, cand(co, 2.0), None), Rung(2, cand(co, 4.0), cand(pd, 3.0)),
             Rung(8, cand(co, 8.0), cand(pd, 12.0)), Rung(16, cand(co, None), cand(pd, None))]
    assert [r.winner for r in rungs] == ["colocated", "colocated", "disaggregated", "neither"]
    assert ladder_verdict(rungs) == (
        "disaggregation gives the most goodput per GPU at 8 GPUs; colocated gives the most "
        "at 1, 2 GPUs; "
        "no deployment of 16 GPUs meets the SLOs at any rate")


def test_deploy_commands_start_each_pool_with_its_tp() -> None:
    same = Shape(SimConfig("disagg", n_prefill=2, n_decode=3), 2, 2)
    assert deploy_commands(same, "--model org/m") == [
        "splitserve serve --model org/m --prefill 2 --decode 3 --prefill-policy power_of_two "
        "--decode-policy power_of_two --prefill-tp 2 --decode-tp 2"]
    tp1 = Shape(SimConfig("disagg", n_prefill=1, n_decode=1, p_policy="cache", d_policy="cache"),
                1, 1)
    assert deploy_commands(tp1, "--embedded") == [
        "splitserve serve --embedded --prefill 1 --decode 1 --prefill-policy cache "
        "--decode-policy cache"]
    apart = deploy_commands(Shape(SimConfig("disagg", n_prefill=1, n_decode=2), 8, 4), "--model m")
    assert apart == ["splitserve serve --model m --prefill 1 --decode 2 --prefill-policy "
                     "power_of_two --decode-policy power_of_two --prefill-tp 8 "
                     "--decode-tp 4"]
    moon = deploy_commands(Shape(SimConfig("disagg", connector="mooncake"), 1, 1), "--embedded")
    assert moon == ["splitserve serve --embedded --prefill 1 --decode 1 --prefill-policy "
                    "power_of_two --decode-policy power_of_two --connector mooncake"]
    assert deploy_commands(Shape(SimConfig("chunked", n_workers=2), 4), "--embedded") == [
        "splitserve serve --embedded --colocated 2 --colocated-tp 4"]
    # every command parses as splitserve serve's flags
    from splitserve.cli import build_parser
    from splitserve.launch.cli import config_from_args
    for line in (*deploy_commands(same, "--model org/m"), *apart):
        argv = line.split()[1:]
        cfg = config_from_args(build_parser().parse_args(argv))
        assert cfg.connector == "splitserve" and cfg.prefill_tp > 1
    assert deploy_commands(Shape(SimConfig("chunked", n_workers=4), 1), "--embedded") == [
        "splitserve serve --embedded --colocated 4"]


def test_deploy_commands_serve_the_dtype_the_plan_sized() -> None:
    """The analytic profiles' bytes a value name serve's `--dtype` (serve's own default is
    float32, twice bf16's memory); a measured profile, or a width serve has no dtype for,
    names none."""
    tp2 = Shape(SimConfig("disagg", n_prefill=1, n_decode=1), 2, 2)
    assert deploy_commands(tp2, "--model org/m", "bfloat16") == [
        "splitserve serve --model org/m --dtype bfloat16 --prefill 1 --decode 1 "
        "--prefill-policy power_of_two --decode-policy power_of_two --prefill-tp 2 "
        "--decode-tp 2"]
    assert deploy_commands(Shape(SimConfig("chunked", n_workers=2), 1), "--embedded",
                           "float32") == ["splitserve serve --embedded --dtype float32 "
                                          "--colocated 2"]
    from splitserve.cli import build_parser
    from splitserve.launch.cli import config_from_args
    argv = deploy_commands(tp2, "--model org/m", "bfloat16")[0].split()[1:]
    assert config_from_args(build_parser().parse_args(argv)).dtype == "bfloat16"

    def analytic(dtype_bytes: int, tp: int = 1) -> Profile:
        return analytic_profile(replace(L8, dtype_bytes=dtype_bytes), PRESETS["h100-sxm"], tp=tp)

    assert serve_dtype({1: analytic(2), 2: analytic(2, 2)}) == "bfloat16"
    assert serve_dtype({1: analytic(4)}) == "float32"
    assert serve_dtype({1: analytic(1)}) is None
    assert serve_dtype({1: replace(analytic(2), kind="measured")}) is None


def test_plan_gpus_end_to_end(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(CONFIG)
    out = tmp_path / "plan"
    assert main(["plan", "--gpus", "2", "--model-config", str(cfg), "--tp", "1,2",
                 "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--num-prompts", "60",
                 "--request-rate", "2", "--input-len", "2000", "--output-len", "50",
                 "--out-dir", str(out)]) == 0
    doc = json.loads((out / "gpuplan.json").read_text())
    assert doc["gpus"] == 2 and doc["advice"]
    assert doc["deploy"][0].startswith(f"splitserve serve --model {cfg} --dtype bfloat16 ")
    assert [r["gpus"] for r in doc["ladder"]] == [1, 2]
    assert (out / "gpuplan.png").stat().st_size > 0
    assert main(["plan", "--gpus", "2", "--model-config", str(cfg), "--dtype-bytes", "4",
                 "--tp", "1", "--no-ladder", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50",
                 "--num-prompts", "20", "--request-rate", "2", "--out-dir", str(out)]) == 0
    doc = json.loads((out / "gpuplan.json").read_text())
    assert doc["deploy"][0].startswith(f"splitserve serve --model {cfg} --dtype float32 ")
