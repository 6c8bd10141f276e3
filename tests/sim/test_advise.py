"""`splitserve advise` end to end on the embedded model here: measured profile, plan over a
2-core budget, the choice started and measured beside a plain worker, predicted against
measured; and the analytic path for a GPU preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.cli import main

WORKLOAD = ["--num-prompts", "8", "--request-rate", "2", "--input-len", "400",
            "--output-len", "24", "--seed", "3"]


@pytest.mark.integration
def test_advise_profiles_plans_and_verifies_here(tmp_path: Path) -> None:
    out = tmp_path / "advise"
    assert main(["advise", "--embedded", "--hardware", "cpu", "--gpus", "2",
                 "--slo-ttft-ms", "4000", "--slo-tpot-ms", "400", *WORKLOAD,
                 "--out-dir", str(out)]) == 0
    doc = json.loads((out / "advise.json").read_text())
    assert doc["profiles"] == {"1": "measured"}
    assert doc["best"]["gpus"] <= 2 and doc["advice"]
    assert [r["gpus"] for r in doc["ladder"]] == [1, 2]
    assert doc["deploy"][0].startswith("splitserve serve --embedded ")
    check = doc["verification"]
    if check["verified"]:
        rows = {r["metric"]: r for r in check["rows"]}
        for key in ("median_ttft_ms", "median_tpot_ms", "request_throughput"):
            assert rows[key]["predicted"] > 0 and rows[key]["measured"] > 0, rows[key]
            assert rows[key]["colocated_measured"] > 0
        assert (out / "verify" / "advised.json").exists()
    else:  # only a choice of several colocated workers cannot be started by the benchmark
        assert doc["best"]["mode"] != "disagg" and doc["best"]["n_workers"] > 1, check


def test_advise_on_a_gpu_preset_is_analytic_and_says_it_is_not_verified(tmp_path: Path
                                                                        ) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        '{"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, '
        '"num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}')
    out = tmp_path / "advise"
    assert main(["advise", "--model", str(model), "--hardware", "h100-sxm", "--gpus", "4",
                 "--tp", "1,2", "--slo-ttft-ms", "500", "--slo-tpot-ms", "40", *WORKLOAD,
                 "--out-dir", str(out)]) == 0
    doc = json.loads((out / "advise.json").read_text())
    assert doc["profiles"] == {"1": "analytic", "2": "analytic"}
    assert doc["verification"] == {"verified": False,
                                   "why": "no h100-sxm here: the plan is analytic"}
    assert doc["deploy"][0].startswith(f"splitserve serve --model {model} --dtype bfloat16 ")
    assert [r["gpus"] for r in doc["ladder"]] == [1, 2, 4]
