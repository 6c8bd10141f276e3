"""Metric functions against hand-computed examples (multi-token chunks, failed requests)."""

from __future__ import annotations

import pytest

from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import (
    SLO,
    compute_metrics,
    distserve_goodput,
    itls_s,
    meets_slo,
    spread,
    tpot_s,
    ttft_s,
)


def rec(index: int, send: float, chunks: list[tuple[float, int]], error: str | None = None,
        input_len: int = 10) -> RequestRecord:
    r = RequestRecord(index=index, kind="normal", input_len=input_len,
                      requested_output_len=4, scheduled_s=send, send_s=send)
    r.chunk_times = [t for t, _ in chunks]
    r.chunk_tokens = [n for _, n in chunks]
    r.end_s = chunks[-1][0] if chunks else send + 0.01
    r.error_cause = error
    r.status = 200 if error is None else 503
    return r


@pytest.fixture()
def records() -> list[RequestRecord]:
    return [
        # 4 tokens in 3 chunks, one of them carrying 2 tokens.
        rec(0, 0.0, [(0.1, 1), (0.15, 2), (0.35, 1)], input_len=10),
        rec(1, 1.0, [(1.2, 1), (1.3, 1)], input_len=20),
        rec(2, 2.0, [], error="http_503", input_len=30),
        # Failed mid-stream: its chunk must not enter TTFT or ITL.
        rec(3, 2.5, [(2.6, 1), (2.9, 1)], error="stream", input_len=40),
    ]


def test_per_request_definitions(records: list[RequestRecord]) -> None:
    a = records[0]
    assert ttft_s(a) == pytest.approx(0.1)
    assert tpot_s(a) == pytest.approx(0.25 / 3)  # (last - first) / (tokens - 1), tokens = 4
    assert itls_s(a) == pytest.approx([0.05, 0.2])  # per chunk, not per token
    assert ttft_s(records[3]) is None and itls_s(records[3]) == []


def test_run_metrics(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=4.0, slo=SLO(ttft_ms=150, tpot_ms=90))
    assert (m["completed"], m["failed"], m["num_prompts"]) == (2, 2, 4)
    assert m["errors"] == {"http_503": 1, "stream": 1}
    assert m["error_rate"] == pytest.approx(0.5)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["total_token_throughput"] == pytest.approx(36 / 4)
    # TTFT [100, 200] ms; TPOT [83.33, 100] ms; E2EL [350, 300] ms.
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(150)
    assert m["mean_tpot_ms"] == pytest.approx((250 / 3 + 100) / 2)
    assert m["max_e2el_ms"] == pytest.approx(350)
    # Pooled chunk gaps: [50, 200, 100] ms; numpy linear percentiles on [50, 100, 200].
    assert m["mean_itl_ms"] == pytest.approx(350 / 3)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["p90_itl_ms"] == pytest.approx(180)
    assert m["p99_itl_ms"] == pytest.approx(198)
    assert m["p999_itl_ms"] == pytest.approx(199.8)
    assert m["max_itl_ms"] == pytest.approx(200)
    assert m["median_handover_ms"] == pytest.approx(75)  # first gaps: 50 and 100
    assert m["max_itl_after_first_ms"] == pytest.approx(200)  # only request 0 has a 2nd gap
    assert m["median_itl_after_first_ms"] == pytest.approx(200)
    # Only request 0 meets both targets; the two failures count as misses.
    assert m["slo_attainment"] == pytest.approx(0.25)
    assert m["request_goodput"] == pytest.approx(0.25)
    assert m["max_output_tokens_per_s"] == 4  # 1 + 2 + 1 tokens in second 0
    assert m["max_concurrent_requests"] == 1
    assert m["output_lens"] == [4, 2, 0, 0]
    assert len(m["itls"]) == 4 and m["itls"][2] == []


def test_usage_count_wins_over_chunk_count(records: list[RequestRecord]) -> None:
    r = records[1]
    r.usage_output_tokens = 5  # e.g. chunks without token ids that carried several tokens
    assert tpot_s(r) == pytest.approx(0.1 / 4)


def test_slo_edge_cases(records: list[RequestRecord]) -> None:
    one = rec(9, 0.0, [(0.05, 1)])
    assert meets_slo(one, SLO(ttft_ms=100, tpot_ms=1))  # one token: no TPOT to miss
    assert not meets_slo(records[2], SLO(ttft_ms=1e9))
    assert compute_metrics(records, 1.0)["slo_attainment"] is None
    with pytest.raises(ValueError):
        SLO(ttft_ms=0)


def test_empty_statistics_are_null() -> None:
    m = compute_metrics([rec(0, 0.0, [], error="connect")], duration_s=1.0)
    assert m["completed"] == 0 and m["p99_itl_ms"] is None and m["median_ttft_ms"] is None
    with pytest.raises(ValueError):
        compute_metrics([], duration_s=0.0)


def test_distserve_goodput_interpolates_between_bracketing_rates() -> None:
    g = distserve_goodput([(4.0, 0.7), (1.0, 1.0), (2.0, 0.95)])
    assert g["value"] == pytest.approx(2.0 + 0.05 / 0.25 * 2.0)
    assert g["bracket"] == [2.0, 4.0] and g["bound"] == "interpolated"
    # Not monotone: the highest rate that meets 90 % decides.
    g = distserve_goodput([(1, 0.95), (2, 0.8), (3, 0.92), (4, 0.5)])
    assert g["value"] == pytest.approx(3 + 0.02 / 0.42)
    assert distserve_goodput([(1, 0.99), (2, 0.91)]) | {} == {
        "value": 2, "bound": "lower", "bracket": [2, None], "target": 0.9}
    assert distserve_goodput([(1, 0.5)])["value"] is None


def test_spread_over_repeats() -> None:
    s = spread([{"p99_itl_ms": 10.0, "x": None}, {"p99_itl_ms": 14.0, "x": 1}])
    assert s["p99_itl_ms"] == {"mean": 12.0, "std": pytest.approx(2 ** 0.5 * 2), "min": 10.0,
                               "max": 14.0, "n": 2}
