"""`splitserve bench` arguments → workload spec and run options (no server needed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from splitserve.bench.cli import options_from_args, parse_named_url, spec_from_args
from splitserve.bench.deploy import Arm, parse_arm
from splitserve.bench.workload import INTERFERENCE
from splitserve.cli import build_parser


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["bench", "--url", "http://h:1", "--result-json", "r.json",
                                      *argv])


def test_interference_options() -> None:
    args = parse("--workload", "interference", "--interference-duration", "12",
                 "--interference-long-period", "4", "--seed", "3")
    spec = spec_from_args(args)
    assert spec.source == "interference" and spec.seed == 3
    assert spec.interference.duration_s == 12 and spec.interference.long_period_s == 4
    assert spec.interference.long_input == INTERFERENCE.long_input


def test_synthetic_options_and_spec_json(tmp_path: Path) -> None:
    args = parse("--input-dist", "normal", "--input-len", "200", "--input-std", "20",
                 "--input-min", "100", "--input-max", "300", "--arrival", "gamma",
                 "--burstiness", "0.5", "--request-rate", "3", "--max-concurrency", "4",
                 "--slo-ttft-ms", "500", "--sweep-rates", "1,2,4")
    spec, opts = spec_from_args(args), options_from_args(args)
    assert (spec.input.kind, spec.input.mean, spec.input.std) == ("normal", 200, 20.0)
    assert (spec.arrival.kind, spec.arrival.burstiness, spec.arrival.max_concurrency) == (
        "gamma", 0.5, 4)
    assert opts.sweep_rates == (1.0, 2.0, 4.0) and opts.slo.ttft_ms == 500
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert spec_from_args(parse("--spec-json", str(path))) == spec


def test_named_urls_and_arms() -> None:
    assert parse_named_url("a=http://h:1") == ("a", "http://h:1")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_named_url("http://h:1")
    assert parse_arm("c=colocated:128", (0, 1)) == Arm("c", "colocated", (0, 1), 128)
    assert parse_arm("d=disagg", (0, 1)).transport == "shm"
    assert parse_arm("d=disagg", (0, 1)).connector == "splitserve"
    assert parse_arm("t=disagg:tcp", (0, 1)) == Arm("t", "disagg", (0, 1), transport="tcp")
    nixl = parse_arm("n=disagg:nixl", (0, 1))
    assert nixl == Arm("n", "disagg", (0, 1), connector="nixl")
    assert nixl.description()["connector"] == "nixl" and nixl.description()["transport"] is None
    with pytest.raises(ValueError):
        parse_arm("d=disagg:rdma", (0, 1))
    with pytest.raises(ValueError):
        parse_arm("d=disagg", (0,))
    with pytest.raises(ValueError):
        parse_arm("x=sideways", (0, 1))
