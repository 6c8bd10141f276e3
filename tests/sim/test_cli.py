"""`splitserve profile --analytic`, `splitserve sim` and `splitserve plan` end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.sim.model import load_profile, save_profile
from tests.sim.conftest import LINK, make_profile

WORKLOAD = ["--num-prompts", "300", "--input-dist", "uniform", "--input-len", "200",
            "--input-min", "50", "--input-max", "400", "--output-len", "30",
            "--request-rate", "4", "--seed", "3"]


def test_sim_writes_the_benchmark_schema(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    out = tmp_path / "r.json"
    assert main(["sim", "--profile", str(prof), "--mode", "disagg", "--prefill", "1",
                 "--decode", "2", *WORKLOAD, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "splitserve.bench/1" and res["simulated"] is True
    assert res["system"] == "sim:1P2D"
    assert res["completed"] == 300 and res["total_output_tokens"] == 300 * 30
    assert 0.0 <= res["slo_attainment"] <= 1.0
    assert res["sim"]["workload"]["num_requests"] == 300


def test_sim_refuses_a_profile_from_another_vllm(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    d = make_profile().to_dict() | {"kind": "measured"}
    d["engine"]["version"] = "0.9.1"
    prof = tmp_path / "old.json"
    prof.write_text(json.dumps(d))
    assert main(["sim", "--profile", str(prof), *WORKLOAD]) == 2
    assert "0.9.1" in capsys.readouterr().err
    assert main(["sim", "--profile", str(prof), "--accept-profile-mismatch", *WORKLOAD]) == 0


def test_analytic_profile_and_plan(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
           "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prof = tmp_path / "gpu.json"
    assert main(["profile", "--analytic", "--model-config", str(tmp_path),
                 "--hardware", "h100-sxm", "--out", str(prof)]) == 0
    p = load_profile(prof, engine_version="0.32.0")
    assert p.kind == "analytic" and p.hardware["note"].startswith("analytic")
    assert p.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # GQA-aware, not hidden_size
    assert list(p.transfer) == ["rdma"]
    out = tmp_path / "plan"
    assert main(["plan", "--profile", str(prof), "--workers", "3", *WORKLOAD,
                 "--slo-ttft-ms", "300", "--slo-tpot-ms", "40", "--out-dir", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    labels = [c["label"] for c in plan["candidates"]]
    assert labels == ["colocated", "chunked", "1P:2D", "2P:1D"]
    assert plan["best"] in labels
    assert (out / "plan.png").stat().st_size > 0


def test_sim_rate_sweep_reports_distserve_goodput(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    out = tmp_path / "sweep.json"
    assert main(["sim", "--profile", str(prof), "--mode", "chunked", "--workers", "1",
                 *WORKLOAD, "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50",
                 "--sweep-rates", "1,4,16,64", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    pts = res["sweep"]["points"]
    assert [p["rate"] for p in pts] == [1.0, 4.0, 16.0, 64.0]
    att = [p["slo_attainment"] for p in pts]
    assert att[0] >= 0.9 > att[-1]  # one worker meets the SLO at 1 req/s, not at 64
    g = res["sweep"]["distserve_goodput"]
    assert res["sweep"]["rate_unit"] == "req/s"
    assert g["bound"] == "interpolated" and g["bracket"][0] < g["value"] < g["bracket"][1]


def test_sim_and_plan_refuse_rates_a_workload_does_not_have(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace is sent on its own timestamps: a sweep of its rate, or a plan over it, would
    label one replayed stream with rates it never had."""
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_len,output_len\n0.0,20,3\n0.5,30,4\n")
    on_trace = ["--profile", str(prof), "--workload", "trace", "--dataset-path", str(trace),
                "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"]
    assert main(["sim", *on_trace, "--mode", "chunked", "--workers", "1", "--sweep-rates",
                 "1,4", "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.startswith(
        "splitserve sim: --sweep-rates: a trace workload is sent on its own clock")
    assert main(["plan", *on_trace, "--workers", "2", "--out-dir", str(tmp_path / "plan")]) == 2
    assert capsys.readouterr().err.startswith("splitserve plan: planning sweeps the request rate")
    assert not (tmp_path / "plan").exists()


SLOS = ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"]
GPUS = ["plan", "--gpus", "2", *SLOS]


@pytest.mark.parametrize(("argv", "message"), [
    (["sim", "--prefill", "0"], "splitserve sim: disaggregated serving needs n_prefill >= 1"),
    (["sim", "--transport", "foo"], "splitserve sim: profile has no transfer numbers for 'foo'"),
    (["sim", "--token-budget", "0"], "splitserve sim: token_budget must be >= 1"),
    (["sim", "--router-hop-ms", "-1"], "splitserve sim: router_hop_s, pull_request_s"),
    (["sim", "--num-prompts", "0"], "splitserve sim: num_requests must be >= 1"),
    (["sim", "--decode-profile", "/nonexistent.json"], "splitserve sim: [Errno 2]"),
    (["plan", "--workers", "0", *SLOS], "splitserve plan: the worker budget must be >= 1"),
    (["plan", "--workers", "2", "--target", "0", *SLOS], "splitserve plan: target attainment"),
    (["plan", "--workers", "2", "--max-concurrency", "4", *SLOS],
     "splitserve plan: the simulator replays open-loop arrivals"),
    (["plan", "--workers", "1", "--connector", "compare", *SLOS],
     "splitserve plan: comparing connectors needs a worker budget >= 2"),
    (["plan", "--gpus", "0", *SLOS], "splitserve plan: gpus and shortlist must be >= 1"),
    ([*GPUS, "--max-concurrency", "4"], "splitserve plan: the simulator replays open-loop"),
    ([*GPUS, "--connector", "nixl"], "splitserve plan: --gpus plans splitserve's connector"),
    ([*GPUS, "--transport", "tcp", "--no-overlap"], "it takes no --transport, --no-overlap"),
    ([*GPUS, "--pull-request-ms", "3"], "it takes no --pull-request-ms"),
    ([*GPUS, "--token-budget", "64"], "it takes no --token-budget"),
    (["profile", "--refit", "/nonexistent.json"], "splitserve profile: [Errno 2]"),
    (["profile", "--analytic"], "splitserve profile: --analytic needs --model-config"),
    (["profile"], "splitserve profile: give --url of a running worker, or --analytic"),
    (["sim", "--sweep-rates", "1,2"], "splitserve sim: a rate sweep needs an SLO"),
    (["sim", "--cache-block-tokens", "0"], "splitserve sim: --cache-block-tokens must be >= 1"),
    (["sim", "--mode", "chunked", "--decode-profile", "/nonexistent.json"],
     "splitserve sim: --decode-profile is for --mode disagg"),
    (["plan", "--workers", "4", "--request-rate", "1"],
     "splitserve plan: --slo-ttft-ms and --slo-tpot-ms are required"),
    (["plan", *SLOS], "splitserve plan: give --workers N"),
    ([*GPUS, "--tp", "2"], "splitserve plan: a measured --profile is one TP-1 worker"),
    ([*GPUS, "--policies", "cache,best"], "splitserve plan: unknown --policies ['best']"),
    (["advise", "--gpus", "2", "--num-prompts", "5"],
     "splitserve advise: --slo-ttft-ms and --slo-tpot-ms are required"),
    (["advise", "--gpus", "0", *SLOS], "splitserve advise: --gpus must be >= 1"),
    (["advise", "--gpus", "2", "--tp", "2", *SLOS],
     "splitserve advise: --hardware cpu plans TP-1 workers"),
    # refused before a worker is profiled here
    (["advise", "--gpus", "2", "--policies", "cache,best", *SLOS],
     "splitserve advise: unknown --policies ['best']"),
    (["advise", "--gpus", "2", "--target", "1.5", *SLOS],
     "splitserve advise: target attainment must be in (0, 1]"),
])
def test_bad_input_is_refused_in_one_line(argv: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Every command refuses an invalid option, workload or file with one line on stderr and
    exit status 2, and writes nothing."""
    prof = tmp_path / "p.json"
    save_profile(replace(make_profile(), transfer={"tcp": LINK, "nixl": LINK}), prof)
    where = {"sim": ["--profile", str(prof), "--out", str(tmp_path / "out.json")],
             "plan": ["--profile", str(prof), "--out-dir", str(tmp_path / "plan")],
             "profile": ["--out", str(tmp_path / "out.json")],
             "advise": ["--out-dir", str(tmp_path / "advise")]}
    assert main([*argv, *where[argv[0]]]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize("argv", [
    ["sim", "--mode", "disagg", "--prefill", "1", "--decode", "1", "--num-prompts", "5"],
    ["plan", "--workers", "2", *SLOS],
])
def test_a_missing_profile_is_refused_in_one_line(argv: list[str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`sim` and `plan --workers` without `--profile`: one line, exit status 2, nothing
    written."""
    assert main([*argv, "--out-dir" if argv[0] == "plan" else "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"splitserve {argv[0]}: --profile is required (make one with "
                   "`splitserve profile`)\n")
    assert not list(tmp_path.iterdir())
