"""`benchmarks/mooncake_shape.py` on tiny Mooncake-format traces: the unbounded cache ratio by
hand on four requests; one LRU cache's hit rate grows with its capacity up to that ratio; in the
simulator a cache-aware router hits at least as often as a cache-blind one at every capacity,
and more capacity never lowers its hit rate; the command writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from splitserve.bench.mooncake import TraceRow, TraceShape, make_trace, write_mooncake
from tests.support.scripts import load_script

BLOCK = 16  # the generated trace's hash-block size


@pytest.fixture(scope="module")
def shape() -> ModuleType:
    return load_script("mooncake_shape")


def _four(path: Path) -> Path:
    """Blocks of 4 tokens: r1 [0,1] 8 tokens; r2 [0,1,2] 10 (block 2 partial); r3 [0,3] 6;
    r4 = r1 again."""
    rows = [TraceRow(0.0, 8, 2, (0, 1)), TraceRow(100.0, 10, 2, (0, 1, 2)),
            TraceRow(200.0, 6, 2, (0, 3)), TraceRow(300.0, 8, 2, (0, 1))]
    return write_mooncake(rows, path)


def _conversations(path: Path, block: int = BLOCK) -> Path:
    shape = TraceShape(sessions=16, max_turns=4, system_blocks=2, session_rate=4.0, think_s=2.0,
                       user_min=2 * block, user_max=12 * block, output_min=4, output_max=40,
                       block_tokens=block)
    return write_mooncake(make_trace(shape, seed=2), path)


def test_unbounded_ratio_by_hand(shape: ModuleType, tmp_path: Path) -> None:
    wl = shape.load_trace(_four(tmp_path / "t.jsonl"), block_tokens=4)
    u = shape.unbounded_ratio(wl)
    # hits: r1 0; r2 blocks 0,1 = 8; r3 block 0 = 4; r4 both blocks, 8 = its whole prompt
    assert (u["prompt_tokens"], u["hit_tokens"]) == (32, 20)
    assert u["ratio"] == pytest.approx(20 / 32)
    # the engine computes the last token: r4 reuses one block of its two (8 tokens -> 4)
    assert u["engine"] == pytest.approx(16 / 32)
    assert u["request_mean"] == pytest.approx((0 + 8 / 10 + 4 / 6 + 8 / 8) / 4)
    assert u["any_position"] == pytest.approx(u["ratio"])  # the ids name whole prefixes
    # one block of room: only r4 finds its first block (r3 stored it last)
    assert shape.lru_hit_rate(wl, 4) == pytest.approx(4 / 32)
    assert shape.lru_hit_rate(wl, 10**6) == pytest.approx(u["engine"])


def test_any_position_counts_a_repeat_after_a_miss(shape: ModuleType, tmp_path: Path) -> None:
    rows = [TraceRow(0.0, 8, 2, (0, 1)), TraceRow(1.0, 7, 2, (2, 1))]  # block 1 again, 3 tokens
    u = shape.unbounded_ratio(shape.load_trace(write_mooncake(rows, tmp_path / "t.jsonl"),
                                               block_tokens=4))
    assert (u["ratio"], u["any_position"]) == (0.0, pytest.approx(3 / 15))


def test_lru_grows_with_capacity_to_the_unbounded_ratio(shape: ModuleType,
                                                        tmp_path: Path) -> None:
    wl = shape.load_trace(_conversations(tmp_path / "c.jsonl"), block_tokens=BLOCK)
    rates = [shape.lru_hit_rate(wl, c * BLOCK) for c in (1, 4, 16, 64, 256, 10**6)]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert rates[-1] == pytest.approx(shape.unbounded_ratio(wl)["engine"])


def test_aware_routing_hits_more_and_capacity_never_hurts_it(shape: ModuleType,
                                                              tmp_path: Path) -> None:
    wl = shape.load_trace(_conversations(tmp_path / "c.jsonl"), time_scale=4.0,
                          block_tokens=BLOCK)
    profile = shape.profile_for("h100-sxm")
    caps = shape.capacities(wl, profile)
    low = shape.min_capacity(wl)
    assert caps[0] == low and low >= int((wl.prompt_lens + wl.output_lens).max())
    assert caps == sorted(caps) and caps[-1] >= int((wl.prompt_lens + wl.output_lens).sum())
    rows = shape.capacity_sweep(profile, wl, shape.Cluster(3, 4.0, 0.0), caps)
    assert all(r["failed"] == 0 for r in rows)
    aware = [r["aware"] for r in rows]
    assert all(r["aware"] >= r["blind"] for r in rows)
    assert any(r["aware"] > r["blind"] for r in rows)
    assert aware == sorted(aware)
    unbounded = shape.unbounded_ratio(wl)["engine"]
    assert all(max(r["aware"], r["pooled_lru"]) <= unbounded + 1e-9 for r in rows)


def test_the_command_writes_its_tables(shape: ModuleType, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    trace = _conversations(tmp_path / "c.jsonl", block=512)
    out = tmp_path / "r.json"
    assert shape.main(["--conversation", str(trace), "--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (conv,) = res["traces"]
    assert conv["trace"] == "conversation" and conv["paper_cache_ratio"] == 0.40
    assert [a["policy"] for a in conv["routing"]] == ["random", "load", "cache"]
    assert all(a["completed"] == conv["requests"] for a in conv["routing"])
    assert "| cache |" in capsys.readouterr().out
