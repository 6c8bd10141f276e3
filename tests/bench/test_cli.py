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
from splitserve.common.refusal import Refused


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


def test_arm_shape_and_policy() -> None:
    """NAME=disagg[:FIELD...]: KV path, <P>p<D>d and policies, each once, in any order."""
    cache = parse_arm("cache=disagg:shm:2p2d:cache", (0, 1))
    assert cache == Arm("cache", "disagg", (0, 1), transport="shm", prefill=2, decode=2,
                        prefill_policy="cache", decode_policy="cache")
    assert parse_arm("load=disagg:load:2p2d", (0, 1)) == Arm(
        "load", "disagg", (0, 1), prefill=2, decode=2, prefill_policy="load",
        decode_policy="load")
    mixed = parse_arm("m=disagg:nixl:cache/round_robin:3p1d", (0, 1, 2, 3))
    assert (mixed.connector, mixed.prefill, mixed.decode) == ("nixl", 3, 1)
    assert (mixed.prefill_policy, mixed.decode_policy) == ("cache", "round_robin")
    # the old specs keep their meaning: 1P+1D under the router's default policy
    assert parse_arm("d=disagg:tcp", (0, 1)) == Arm("d", "disagg", (0, 1), transport="tcp",
                                                    prefill=1, decode=1)
    desc = cache.description()
    assert desc["roles"] == ["prefill", "prefill", "decode", "decode"]
    assert desc["shape"] == "2P+2D" and desc["shared_cores"] is True
    assert desc["cores_per_worker"] == [1, 1, 1, 1] and "share cores" in desc["core_plan"]
    assert (desc["prefill_policy"], desc["decode_policy"]) == ("cache", "cache")
    assert desc["local_prefill_max_tokens"] == 128 and desc["kv_events"] is True
    blind = parse_arm("load=disagg:load:blind:2p2d", (0, 1))
    assert blind.kv_events is False and blind.description()["kv_events"] is False
    assert parse_arm("d=disagg", (0, 1, 2)).description()["shared_cores"] is False
    for bad, says in (("d=disagg:2p2d:1p1d", "shape twice"),
                      ("d=disagg:cache:load", "policy twice"),
                      ("d=disagg:shm:tcp", "kv path twice"),
                      ("d=disagg:blind:blind", "blind twice"),
                      ("d=disagg:cache/nope", "decode policy 'nope'"),
                      ("d=disagg:fast", "neither a KV path"),
                      ("d=disagg:0p2d", "at least one prefill"),
                      ("c=colocated:2p2d", "token budget"),
                      ("d=disagg:2p2d", None)):
        if says is None:
            parse_arm(bad, (0, 1))  # 4 workers on 2 cores: allowed, they share
            continue
        with pytest.raises(ValueError, match=says):
            parse_arm(bad, (0, 1))


def test_compare_names_a_bad_arm(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.bench.cli import run_compare

    args = build_parser().parse_args(["bench", "compare", "--deploy", "a=disagg:2p2d:cache",
                                      "--deploy", "b=disagg:2p2d:lod"])
    with pytest.raises(Refused, match="^splitserve bench compare: --deploy: 'b=disagg:2p2d:lod'"):
        run_compare(args)


def test_arms_that_draft_take_the_runs_speculative_config() -> None:
    """`spec`: D (or the colocated worker) drafts with --speculative-config; P never does."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    plain = parse_arm("plain=disagg:shm", (0, 1), ngram)
    assert plain.speculative is None
    spec = parse_arm("spec=disagg:spec:shm", (0, 1), ngram)
    assert spec.speculative is not None and json.loads(spec.speculative)["method"] == "ngram"
    assert spec.description()["speculative"] == spec.speculative
    colo = parse_arm("c=colocated:4096:spec", (0, 1), ngram)
    assert (colo.max_num_batched_tokens, colo.speculative) == (4096, spec.speculative)
    assert parse_arm("c=colocated:spec", (0, 1), ngram).max_num_batched_tokens is None
    with pytest.raises(ValueError, match="no --speculative-config"):
        parse_arm("spec=disagg:spec", (0, 1))
    with pytest.raises(ValueError, match="'eagle'"):
        parse_arm("spec=disagg:spec", (0, 1), '{"method": "eagle", "model": "m"}')


def test_a_rate_sweep_of_a_workload_no_rate_sends_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """A trace keeps its own timestamps and a closed loop sends when answers come: each
    "rate" would replay the same stream under another label."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_len,output_len\n0.0,20,3\n")
    from splitserve.bench.cli import run_single

    for argv in (("--workload", "trace", "--dataset-path", str(trace)),
                 ("--arrival", "closed", "--max-concurrency", "4")):
        args = parse(*argv, "--slo-ttft-ms", "500", "--sweep-rates", "1,2")
        with pytest.raises(Refused, match="^splitserve bench: --sweep-rates: .* own clock, not "
                                          "at a rate"):
            run_single(args)
    assert spec_from_args(parse("--sweep-rates", "1,2")).with_rate(2.0).arrival.rate == 2.0
