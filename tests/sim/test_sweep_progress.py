"""`splitserve sim --sweep-rates` shows a progress bar over its rates, as `bench` does (issue 28,
item 5); a single run shows none. `splitserve plan` shows one over its candidates."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.sim.model import save_profile
from tests.sim.conftest import make_profile
from tests.sim.test_cli import WORKLOAD


def test_a_rate_sweep_shows_its_progress(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    args = ["sim", "--profile", str(prof), "--mode", "chunked", "--workers", "1", *WORKLOAD,
            "--slo-ttft-ms", "1000"]
    assert main([*args, "--sweep-rates", "1,4,16"]) == 0
    out = capsys.readouterr().out
    assert "sim:chunkedx1 rates" in out and "3/3" in out, out
    assert main(args) == 0
    assert " rates " not in capsys.readouterr().out


def test_a_plan_shows_its_progress_over_the_candidates(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    assert main(["plan", "--profile", str(prof), "--workers", "3", *WORKLOAD,
                 "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
                 "--out-dir", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    assert "plan: candidates simulated" in out and "4/4" in out, out
