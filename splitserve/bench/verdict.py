"""One-line verdicts: how the last system compares with the baselines before it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def change(new: float | None, old: float | None) -> float | None:
    """Relative change new vs old in percent (None when either is missing or old is 0)."""
    if new is None or old is None or old == 0:
        return None
    return (new - old) / old * 100.0


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.0f} %"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f} ms"


def verdict(results: Mapping[str, dict[str, Any]]) -> str:
    """The last system against each earlier one: p99 ITL, max ITL, median TTFT, failures."""
    names = list(results)
    if len(names) < 2:
        return ""
    cand_name = names[-1]
    cand = results[cand_name]
    parts = []
    for base_name in names[:-1]:
        base = results[base_name]
        parts.append(
            f"vs {base_name}: p99 ITL {_ms(cand.get('p99_itl_ms'))} vs "
            f"{_ms(base.get('p99_itl_ms'))} ({_pct(change(cand.get('p99_itl_ms'), base.get('p99_itl_ms')))}), "  # noqa: E501
            f"max ITL {_pct(change(cand.get('max_itl_ms'), base.get('max_itl_ms')))}, "
            f"TTFT p50 {_pct(change(cand.get('median_ttft_ms'), base.get('median_ttft_ms')))}")
    failed = sum(r.get("failed", 0) for r in results.values())
    tail = f"; {failed} failed requests in all" if failed else ""
    return f"{cand_name} " + "; ".join(parts) + tail


def demo_verdict(unchunked: dict[str, Any], chunked: dict[str, Any],
                 disagg: dict[str, Any] | None, target_pct: float = 90.0) -> str:
    """The demo's claim: disaggregated p99 ITL ≥ 90 % below the chunked baseline's p99, and
    disaggregated max ITL ≥ 90 % below the unchunked baseline's max, at the stated TTFT cost."""
    if disagg is None:
        return ("VERDICT: no disaggregated arm ran; colocated chunked vs unchunked: p99 ITL "
                f"{_pct(change(chunked.get('p99_itl_ms'), unchunked.get('p99_itl_ms')))}, "
                f"max ITL {_pct(change(chunked.get('max_itl_ms'), unchunked.get('max_itl_ms')))}")
    p99 = change(disagg.get("p99_itl_ms"), chunked.get("p99_itl_ms"))
    mx = change(disagg.get("max_itl_ms"), unchunked.get("max_itl_ms"))
    ttft_u = change(disagg.get("median_ttft_ms"), unchunked.get("median_ttft_ms"))
    ttft_c = change(disagg.get("median_ttft_ms"), chunked.get("median_ttft_ms"))
    ok = p99 is not None and mx is not None and p99 <= -target_pct and mx <= -target_pct
    failed = disagg.get("failed", 0)
    return (
        f"VERDICT: {'MET' if ok and not failed else 'NOT MET'} — 1P+1D p99 ITL "
        f"{_ms(disagg.get('p99_itl_ms'))} vs chunked {_ms(chunked.get('p99_itl_ms'))} "
        f"({_pct(p99)}); max ITL {_ms(disagg.get('max_itl_ms'))} vs unchunked "
        f"{_ms(unchunked.get('max_itl_ms'))} ({_pct(mx)}); TTFT p50 cost "
        f"{_pct(ttft_u)} vs unchunked, {_pct(ttft_c)} vs chunked"
        + (f"; {failed} failed" if failed else "")
    )
