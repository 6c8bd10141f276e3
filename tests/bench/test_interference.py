"""The ITL interference ratio on hand-built records: gaps inside and outside long prompts'
prefill windows ([send, first token]), window edges, multi-token chunks, failed requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import compute_metrics, interference, prefill_windows, split_gaps
from splitserve.bench.report import plot_itl_over_time, table_rows


def rec(index: int, send: float, chunks: list[tuple[float, int]], kind: str = "short",
        error: str | None = None, end: float | None = None) -> RequestRecord:
    r = RequestRecord(index=index, kind=kind, input_len=10, requested_output_len=4,
                      scheduled_s=send, send_s=send)
    r.chunk_times = [t for t, _ in chunks]
    r.chunk_tokens = [n for _, n in chunks]
    r.end_s = end if end is not None else (chunks[-1][0] if chunks else send)
    r.error_cause = error
    return r


@pytest.fixture()
def records() -> list[RequestRecord]:
    return [
        # Long prompt: window [1.0, 2.0]; its own gaps come after it (outside: 20, 20 ms).
        rec(0, 1.0, [(2.0, 1), (2.02, 1), (2.04, 1)], kind="long"),
        # Gaps 20, 780 ms before the window (outside), 200 and 100 ms inside it (the chunk at
        # 1.2 carries 3 tokens: still one gap), 900 ms from inside to after it (during).
        rec(1, 0.0, [(0.1, 1), (0.12, 1), (0.9, 1), (1.1, 1), (1.2, 3), (2.1, 1)]),
        # Edges: a gap ending at the window's start and one starting at its end touch it only
        # (outside: 200, 30 ms); the 1000 ms gap spanning it is during.
        rec(2, 0.5, [(0.8, 1), (1.0, 1), (2.0, 1), (2.03, 1)]),
        # A failed request's chunks are no gaps at all, wherever they fall.
        rec(3, 1.4, [(1.5, 1), (1.9, 1)], error="stream"),
        # A long prompt that failed before its first token: window [send, end] = [5.0, 6.0].
        rec(4, 5.0, [], kind="long", error="http_503", end=6.0),
        # 600, 100 (2-token chunk), 900 ms overlap [5, 6] (during); 20 ms after it (outside).
        rec(5, 4.0, [(4.9, 1), (5.5, 2), (5.6, 1), (6.5, 1), (6.52, 1)]),
    ]


def test_gaps_are_split_by_overlap_with_any_long_prefill(records: list[RequestRecord]) -> None:
    windows = prefill_windows(records)
    assert windows == [(1.0, 2.0), (5.0, 6.0)]
    during, outside = split_gaps(records, windows)
    assert sorted(during) == pytest.approx([0.1, 0.1, 0.2, 0.6, 0.9, 0.9, 1.0])
    assert sorted(outside) == pytest.approx([0.02, 0.02, 0.02, 0.02, 0.03, 0.2, 0.78])


def test_ratio_of_p50s_and_of_p99s(records: list[RequestRecord]) -> None:
    m = interference(records)
    assert m["itl_interference_long_prompts"] == 2
    assert (m["itl_interference_during_count"], m["itl_interference_outside_count"]) == (7, 7)
    # numpy's linear p99 of 7 sorted values: x[5] + 0.94 (x[6] - x[5]).
    assert m["median_itl_during_prefill_ms"] == pytest.approx(600)
    assert m["p99_itl_during_prefill_ms"] == pytest.approx(994)
    assert m["median_itl_outside_prefill_ms"] == pytest.approx(20)
    assert m["p99_itl_outside_prefill_ms"] == pytest.approx(745.2)
    assert m["itl_interference_p50_ratio"] == pytest.approx(30)
    assert m["itl_interference_p99_ratio"] == pytest.approx(994 / 745.2)
    assert compute_metrics(records, duration_s=7.0).items() >= m.items()


def test_overlapping_long_prompts_make_one_window() -> None:
    recs = [rec(0, 1.0, [(3.0, 1)], kind="long"), rec(1, 2.0, [(2.5, 1)], kind="long"),
            rec(2, 4.0, [(5.0, 1)], kind="long")]
    assert prefill_windows(recs) == [(1.0, 3.0), (4.0, 5.0)]
    # A gap between the windows is outside; one reaching into the second is during.
    during, outside = split_gaps([rec(3, 0.0, [(3.2, 1), (3.9, 1), (4.1, 1)])],
                                 prefill_windows(recs))
    assert during == pytest.approx([0.2]) and outside == pytest.approx([0.7])


def test_no_long_prompts_or_no_gaps_on_a_side_leave_the_ratio_null() -> None:
    plain = [rec(0, 0.0, [(0.1, 1), (0.2, 1)]), rec(1, 0.0, [(0.3, 1), (0.5, 1)])]
    m = interference(plain)
    assert m["itl_interference_long_prompts"] == 0
    assert (m["itl_interference_during_count"], m["itl_interference_outside_count"]) == (0, 2)
    assert m["itl_interference_p50_ratio"] is None and m["itl_interference_p99_ratio"] is None
    # Every gap inside the window: no "outside" to compare with.
    m = interference([rec(0, 0.0, [(9.0, 1)], kind="long"), *plain])
    assert (m["itl_interference_during_count"], m["itl_interference_outside_count"]) == (2, 0)
    assert m["median_itl_during_prefill_ms"] == pytest.approx(150)
    assert m["itl_interference_p50_ratio"] is None


def test_table_and_plot_show_it(records: list[RequestRecord], tmp_path: Path) -> None:
    res = compute_metrics(records, duration_s=7.0) | {
        "requests": [r.to_dict() for r in records]}
    rows = {row[0]: row[1:] for row in table_rows({"arm": res})}
    assert rows["ITL interference p50 (during / outside long prefill)"] == ["30.0"]
    assert rows["ITL interference p99 (during / outside long prefill)"] == ["1.334"]
    assert rows["ITL gaps during / outside long prefill"] == ["7 / 7"]
    png = plot_itl_over_time({"arm": res}, tmp_path / "itl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
