"""The demo's verdict: MET means (a) stalls removed (1P+1D max ITL and p99.9 >= 90 % below the
unchunked baseline), (b) interference removed (1P+1D's ratio <= 1.2 at p50 and p99) and (e) the
price held (1P+1D's TTFT p50 <= 1.1 x unchunked's); the tail against chunked (c) and the TTFT
price in full (d) are reported without a target."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.bench.verdict import (
    demo_verdict,
    interference_removed,
    price_met,
    stalls_removed,
)


def arm(max_itl: float, p999: float, p99: float, r50: float | None, r99: float | None,
        ttft50: float = 40.0, ttft99: float = 400.0, long_ttft: float = 300.0,
        failed: int = 0) -> dict[str, Any]:
    return {"max_itl_ms": max_itl, "p999_itl_ms": p999, "p99_itl_ms": p99,
            "itl_interference_p50_ratio": r50, "itl_interference_p99_ratio": r99,
            "median_ttft_ms": ttft50, "p99_ttft_ms": ttft99, "failed": failed,
            "by_kind": {"long": {"median_ttft_ms": long_ttft}}}


UNCHUNKED = arm(453.0, 305.0, 27.4, 1.28, 19.2, ttft50=38.3, ttft99=430.0, long_ttft=336.0)
CHUNKED = arm(80.3, 43.5, 34.7, 3.49, 1.93, ttft50=43.4, ttft99=474.0, long_ttft=440.0)


def test_met_needs_stalls_and_interference_removed_not_the_chunked_p99() -> None:
    # 1P+1D's p99 is *above* chunked's: (c) has no target, so the verdict is still MET.
    disagg = arm(44.9, 30.0, 40.0, 0.98, 1.09, ttft50=42.0, ttft99=699.0, long_ttft=599.0)
    lines = demo_verdict(UNCHUNKED, CHUNKED, disagg).splitlines()
    assert lines[0] == ("VERDICT: MET: (a) stalls removed met, (b) interference removed met, "
                        "(e) price met")
    assert lines[1].startswith("  (a)") and "max ITL 44.9 ms vs 453 ms (-90 %)" in lines[1]
    assert "p99.9 30.0 ms vs 305 ms (-90 %)" in lines[1]
    assert lines[2].startswith("  (b)") and (
        "1P+1D 0.98 / 1.09; chunked 3.49 / 1.93; unchunked 1.28 / 19.20") in lines[2]
    assert lines[3].startswith("  (c)") and "p99 40.0 ms vs 34.7 ms (+15 %)" in lines[3]
    assert "target" not in lines[3].replace("no target", "")
    assert lines[4].startswith("  (d)") and "TTFT p50 42.0 ms vs 38.3 ms (+10 %)" in lines[4]
    assert "vs 43.4 ms chunked (-3 %)" in lines[4]
    assert "long prompts' TTFT p50 599 ms vs 336 ms unchunked, 440 ms chunked" in lines[4]
    assert lines[5] == "  (e) price, 1P+1D TTFT p50 / unchunked's (target: <= 1.1): 1.10"


@pytest.mark.parametrize(("ttft50", "met"), [(42.13, True), (42.14, False), (57.0, False),
                                             (None, False)])
def test_the_price_decides_too(ttft50: float | None, met: bool) -> None:
    """(e): 1P+1D's TTFT p50 at most 1.1 x unchunked's (38.3 ms: 42.13 holds, 42.14 not); a
    missing TTFT is not shown to hold. (a) and (b) hold here, so (e) alone decides MET."""
    disagg = arm(44.9, 30.0, 40.0, 0.98, 1.09, ttft50=ttft50)  # type: ignore[arg-type]
    assert price_met(disagg, UNCHUNKED) == met
    head = demo_verdict(UNCHUNKED, CHUNKED, disagg).splitlines()[0]
    assert head.startswith("VERDICT: MET:" if met else "VERDICT: NOT MET:")
    assert head.endswith(f"(e) price {'met' if met else 'missed'}")


@pytest.mark.parametrize(("disagg", "a", "b"), [
    (arm(50.0, 30.0, 20.0, 1.0, 1.1), False, True),  # max only -89 %
    (arm(40.0, 31.0, 20.0, 1.0, 1.1), False, True),  # p99.9 only -90 % of 305 = 30.5 missed
    (arm(40.0, 30.0, 20.0, 1.0, 1.21), True, False),  # p99 ratio above 1.2
    (arm(40.0, 30.0, 20.0, 1.25, 1.0), True, False),  # p50 ratio above 1.2
    (arm(40.0, 30.0, 20.0, None, 1.0), True, False),  # no ratio: not shown to hold
    (arm(40.0, 30.0, 20.0, 1.2, 1.2), True, True),  # the targets themselves hold
])
def test_each_part_decides(disagg: dict[str, Any], a: bool, b: bool) -> None:
    assert (stalls_removed(disagg, UNCHUNKED), interference_removed(disagg)) == (a, b)
    head = demo_verdict(UNCHUNKED, CHUNKED, disagg).splitlines()[0]  # (e) holds: ttft50 40
    assert head.startswith("VERDICT: MET:" if a and b else "VERDICT: NOT MET:")
    assert f"(a) stalls removed {'met' if a else 'missed'}" in head
    assert f"(b) interference removed {'met' if b else 'missed'}" in head


def test_failed_requests_or_a_missing_arm() -> None:
    head = demo_verdict(UNCHUNKED, CHUNKED, arm(40.0, 30.0, 20.0, 1.0, 1.0, failed=2))
    assert head.startswith("VERDICT: NOT MET (2 1P+1D requests failed): (a) stalls removed met")
    only = demo_verdict(UNCHUNKED, CHUNKED, None)
    assert only.startswith("VERDICT: no disaggregated arm ran")
    assert "chunked 3.49 / 1.93, unchunked 1.28 / 19.20" in only
