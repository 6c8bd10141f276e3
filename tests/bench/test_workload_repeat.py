"""Workloads that repeat themselves: the Mooncake trace format and its replay, the generator,
ideal reuse, the spec's new parts, and the existing sources' streams left byte-identical."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from splitserve.bench.mooncake import (
    TraceRow,
    TraceShape,
    block_of,
    make_trace,
    read_mooncake,
    scale_lengths,
    tree_keys,
    write_mooncake,
)
from splitserve.bench.repeat import (
    MooncakeOptions,
    MultiturnOptions,
    PrefixPool,
    ideal_reuse_blocks,
    ideal_reuse_tokens,
)
from splitserve.bench.runner import stream_ideal_reuse
from splitserve.bench.workload import (
    ArrivalSpec,
    LengthDist,
    Request,
    WorkloadSpec,
    build_stream,
    build_warmup,
)
from splitserve.cli import main

# ---- the existing sources' streams ------------------------------------------------------

SHAREGPT = [{"conversations": [{"value": "x" * (40 + 13 * i)}, {"value": "y" * (20 + 7 * i)}]}
            for i in range(12)]
TRACE_CSV = "arrival_s,input_len,output_len\n" + "".join(
    f"{0.37 * i:.2f},{30 + 11 * i},{5 + i}\n" for i in range(15))
# (stream, warm-up) hashes recorded from the code before the repeat workloads were added
BEFORE = {
    "synthetic": ("b3af22c194c446f2", "adda483d325ae5ef"),
    "synthetic_uniform_gamma": ("3565dd4381368090", "f73ea1461004b0e7"),
    "synthetic_ramp": ("d643d31682737af1", "cc9ad032c9f31c35"),
    "interference": ("74815955d342db85", "e7789d8a941b3a7f"),
    "sharegpt": ("081ca00f15f00baa", "6b085768cbe821c9"),
    "trace": ("5632509359a643d1", "d2d9546e0aae1103"),
}


def stream_hash(reqs: list[Request]) -> str:
    h = hashlib.sha256()
    for r in reqs:
        h.update(repr((r.index, r.arrival_s, r.prompt_token_ids, r.output_len, r.kind,
                       r.warmup)).encode())
    return h.hexdigest()[:16]


def test_existing_streams_are_byte_identical(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps(SHAREGPT))
    (tmp_path / "t.csv").write_text(TRACE_CSV)
    specs = {
        "synthetic": WorkloadSpec(),
        "synthetic_uniform_gamma": WorkloadSpec(
            num_requests=50, input=LengthDist("uniform", 128, 20, 300),
            output=LengthDist("normal", 40, 1, 100, 15.0),
            arrival=ArrivalSpec("gamma", 3.0, burstiness=0.5), seed=11, warmup=3),
        "synthetic_ramp": WorkloadSpec(num_requests=30,
                                       arrival=ArrivalSpec("ramp", 1.0, ramp_end_rate=5.0),
                                       seed=2),
        "interference": WorkloadSpec(source="interference"),
        "sharegpt": WorkloadSpec(source="sharegpt", path=str(tmp_path / "s.json"),
                                 num_requests=20, seed=4),
        "trace": WorkloadSpec(source="trace", path=str(tmp_path / "t.csv"), seed=9),
    }
    got = {name: (stream_hash(build_stream(s)), stream_hash(build_warmup(s)))
           for name, s in specs.items()}
    assert got == BEFORE
    for s in specs.values():  # and they carry no prefix identity
        assert all(r.hash_ids == () and r.session is None for r in build_stream(s))


# ---- the Mooncake format ----------------------------------------------------------------

def write_rows(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    path.write_text("\n".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                          "hash_ids": ids}) for t, n, o, ids in rows) + "\n\n")
    return path


def mooncake(path: Path, seed: int = 0, **opts: object) -> list[Request]:
    return build_stream(WorkloadSpec(source="mooncake", path=str(path), seed=seed,
                                     mooncake=MooncakeOptions(**opts)))  # type: ignore[arg-type]


def test_read_the_format_and_refuse_bad_rows(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", [(0, 700, 20, [0, 1]), (1500, 100, 5, [0])])
    assert read_mooncake(path) == [TraceRow(0.0, 700, 20, (0, 1)), TraceRow(1500.0, 100, 5, (0,))]
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_mooncake(tmp_path / "bad.jsonl")
    # 1,100 tokens do not fit two 512-token blocks
    write_rows(tmp_path / "long.jsonl", [(0, 1100, 5, [0, 1])])
    with pytest.raises(ValueError, match="row 1"):
        mooncake(tmp_path / "long.jsonl")
    assert len(mooncake(tmp_path / "long.jsonl", block_tokens=1024)) == 1


def test_replay_times_lengths_and_equal_ids_equal_tokens(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", [
        (3000, 20, 4, [7, 8, 9]), (1000, 16, 3, [7, 8]), (2000, 22, 5, [7, 8, 4]),
        (2500, 5, 2, [])])
    reqs = mooncake(path, block_tokens=8)
    assert [(r.arrival_s, r.input_len, r.output_len, r.hash_ids) for r in reqs] == [
        (0.0, 16, 3, (7, 8)), (1.0, 22, 5, (7, 8, 4)), (1.5, 5, 2, ()), (2.0, 20, 4, (7, 8, 9))]
    assert [r.index for r in reqs] == [0, 1, 2, 3]
    # Equal ids at the start: equal tokens; a block is the same wherever it appears.
    assert reqs[0].prompt_token_ids == reqs[1].prompt_token_ids[:16] == \
        reqs[3].prompt_token_ids[:16]
    assert reqs[0].prompt_token_ids[:8] == block_of(0, 7, 8)
    assert reqs[3].prompt_token_ids[16:] == block_of(0, 9, 8)[:4]  # a partial block: a prefix
    assert reqs[1].prompt_token_ids[16:] == block_of(0, 4, 8)[:6]
    assert reqs[1].prompt_token_ids[16:20] != reqs[3].prompt_token_ids[16:20]
    assert all(10 <= t < 500 for r in reqs for t in r.prompt_token_ids)
    assert mooncake(path, block_tokens=8) == reqs  # deterministic
    assert mooncake(path, seed=1, block_tokens=8)[0].prompt_token_ids != reqs[0].prompt_token_ids
    fast = mooncake(path, block_tokens=8, time_scale=4.0)
    assert [r.arrival_s for r in fast] == [0.0, 0.25, 0.375, 0.5]


def test_token_scale_keeps_hash_blocks_whole() -> None:
    opts = MooncakeOptions(token_scale=1 / 16)  # 512-token blocks become 32 tokens
    assert opts.scaled_block_tokens == 32
    assert scale_lengths(TraceRow(0, 1024, 100, (1, 2)), opts) == (64, 6)  # 6.25 -> 6
    assert scale_lengths(TraceRow(0, 1000, 8, (1, 2)), opts) == (63, 1)  # last 488 -> 30.5 -> 31
    assert scale_lengths(TraceRow(0, 513, 1, (1, 2)), opts) == (33, 1)  # a partial block stays
    assert scale_lengths(TraceRow(0, 100, 40, ()), opts) == (6, 3)  # no ids: 6.25, 2.5 -> 3
    assert scale_lengths(TraceRow(0, 700, 9, (1, 2)), MooncakeOptions()) == (700, 9)
    assert MooncakeOptions(block_tokens=512, token_scale=0.001).scaled_block_tokens == 1


def sessions_trace(path: Path) -> Path:
    """Shared block 0; six conversations, ids 10·s + turn, each turn extending the last."""
    rows, t = [], 0
    for s in range(6):
        for turn in range(1 + s % 3):
            ids = [0] + [10 * s + j for j in range(1, turn + 2)]
            rows.append((t, 4 * len(ids), 3, ids))
            t += 100
    return write_rows(path, rows)


def test_sample_sessions_keeps_whole_prefix_trees(tmp_path: Path) -> None:
    path = sessions_trace(tmp_path / "t.jsonl")
    rows = read_mooncake(path)
    assert tree_keys(rows, 0.5)[:3] == [(0, 1), (0, 11), (0, 11)]
    everything = mooncake(path, block_tokens=4)
    assert len(everything) == 12 and len({r.session for r in everything}) == 6
    kept = mooncake(path, block_tokens=4, sample_sessions=0.5)
    trees = {r.session for r in kept}
    assert len(trees) == 3  # round(0.5 × 6)
    assert len(kept) == sum(r.session in trees for r in everything)  # whole trees only
    assert kept[0].arrival_s == 0.0 and mooncake(path, block_tokens=4, sample_sessions=0.5) == kept
    picks = {frozenset(r.session for r in mooncake(path, seed=s, block_tokens=4,
                                                   sample_sessions=0.5)) for s in range(8)}
    assert len(picks) > 1  # the seed chooses
    capped = mooncake(path, block_tokens=4, sample_sessions=0.5, max_requests=2)
    assert [r.prompt_token_ids for r in capped] == [r.prompt_token_ids for r in kept[:2]]
    # An id in more than the shared fraction of rows is no tree of its own.
    assert tree_keys(rows, 1.0)[0] == (0,)


# ---- ideal reuse -----------------------------------------------------------------------

def test_ideal_reuse_on_a_hand_made_trace(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", [
        (0, 8, 1, [1, 2]),      # nothing seen: 0
        (1, 7, 1, [1, 3]),      # block 1 (4 tokens): 4
        (2, 10, 1, [1, 2, 5]),  # blocks 1, 2: 8
        (3, 6, 1, [1, 2]),      # block 1; block 2 is partial here (2 tokens, 4 before): 4
        (4, 5, 1, []),          # no ids: 0
    ])
    ideal = stream_ideal_reuse(WorkloadSpec(source="mooncake", path=str(path),
                                            mooncake=MooncakeOptions(block_tokens=4)),
                               mooncake(path, block_tokens=4))
    assert ideal is not None and (ideal.prompt_tokens, ideal.reused_tokens) == (36, 16)
    assert ideal.to_result() == {"ideal_reuse": 16 / 36, "ideal_reused_tokens": 16,
                                 "ideal_computed_tokens": 20}
    assert ideal_reuse_blocks([], 4).fraction is None
    # By tokens: a turn finds the earlier prompt and the answer generated for it.
    turns = [((1, 2, 3), (9,)), ((1, 2, 3, 9, 4), ()), ((1, 2, 5), ())]
    tokens = ideal_reuse_tokens(turns)
    assert (tokens.prompt_tokens, tokens.reused_tokens) == (11, 6)
    pool = PrefixPool()
    assert pool.match_insert("abc") == 0 and pool.match_insert("abd") == 2


def test_generated_trace(tmp_path: Path) -> None:
    shape = TraceShape(sessions=12, max_turns=4, session_rate=2.0, think_s=3.0)
    rows = make_trace(shape, seed=3)
    assert rows == make_trace(shape, seed=3) and rows != make_trace(shape, seed=4)
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    for r in rows:
        r.check_blocks(512)
        assert r.hash_ids[0] == 0  # every conversation starts with the shared block
    # A follow-up resends the conversation: the full blocks of an earlier turn come back.
    firsts = {r.hash_ids[1]: r for r in rows if len(r.hash_ids) > 2}
    assert any(len(r.hash_ids) > 3 and r.hash_ids[1] in firsts for r in rows)
    out = tmp_path / "gen.jsonl"
    assert main(["bench", "make-trace", "--out", str(out), "--sessions", "12", "--max-turns",
                 "4", "--session-rate", "2", "--think-time", "3", "--seed", "3"]) == 0
    assert read_mooncake(out) == [TraceRow(r.timestamp_ms, r.input_length, r.output_length,
                                           r.hash_ids) for r in rows]
    assert read_mooncake(write_mooncake(rows, tmp_path / "again.jsonl")) == rows
    spec = WorkloadSpec(source="mooncake", path=str(out),
                        mooncake=MooncakeOptions(token_scale=1 / 16))
    reqs = build_stream(spec)
    ideal = stream_ideal_reuse(spec, reqs)
    assert ideal is not None and 0.2 < (ideal.fraction or 0) < 0.9


# ---- the spec ---------------------------------------------------------------------------

def test_spec_round_trip_and_validation(tmp_path: Path) -> None:
    spec = WorkloadSpec(source="mooncake", path="t.jsonl", seed=4, mooncake=MooncakeOptions(
        256, 0.25, 3.0, 100, 0.3, 0.4), multiturn=MultiturnOptions(3, 2, 10, 5, 4, 0.5))
    assert WorkloadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    old = WorkloadSpec().to_dict()
    del old["mooncake"], old["multiturn"]
    assert WorkloadSpec.from_dict(old) == WorkloadSpec()  # results written before them
    for bad in ({"token_scale": 0.0}, {"time_scale": -1.0}, {"sample_sessions": 0.0},
                {"sample_sessions": 1.5}, {"max_requests": 0}, {"block_tokens": 0},
                {"shared_fraction": 0.0}):
        with pytest.raises(ValueError):
            MooncakeOptions(**bad)  # type: ignore[arg-type]
    for bad in ({"sessions": 0}, {"turns": 0}, {"system_tokens": -1}, {"think_time_s": -1.0}):
        with pytest.raises(ValueError):
            MultiturnOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WorkloadSpec(source="mooncake")  # needs a path


def test_cli_options() -> None:
    from splitserve.bench.cli import spec_from_args
    from splitserve.cli import build_parser

    base = ["bench", "--url", "http://h:1", "--result-json", "r.json"]
    args = build_parser().parse_args(base + [
        "--workload", "mooncake", "--dataset-path", "t.jsonl", "--trace-block-tokens", "256",
        "--token-scale", "0.0625", "--time-scale", "8", "--max-requests", "50",
        "--sample-sessions", "0.2", "--shared-block-fraction", "0.3"])
    assert spec_from_args(args).mooncake == MooncakeOptions(256, 0.0625, 8.0, 50, 0.2, 0.3)
    args = build_parser().parse_args(base + [
        "--workload", "multiturn", "--sessions", "2", "--turns", "3", "--system-prompt-tokens",
        "40", "--user-tokens", "8", "--turn-output-tokens", "6", "--think-time", "0.2",
        "--session-rate", "5", "--save-token-ids"])
    spec = spec_from_args(args)
    assert spec.multiturn == MultiturnOptions(2, 3, 40, 8, 6, 0.2)
    assert spec.arrival.rate == 5.0 and args.save_token_ids
