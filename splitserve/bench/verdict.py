"""Verdicts: how the last system compares with the baselines before it (one line), and the
demo's claim in five parts (a)-(e) with its targets."""

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
    if x is None:
        return "n/a"
    return f"{x:.1f} ms" if abs(x) < 100 else f"{x:.0f} ms"


STALL_TARGET_PCT = 90.0  # (a): 1P+1D max ITL and p99.9 at least this much below unchunked
INTERFERENCE_TARGET = 1.2  # (b): 1P+1D interference ratio at p50 and p99 at most this
PRICE_TARGET = 1.1  # (e): 1P+1D TTFT p50 at most this times unchunked colocated's


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ratios(r: dict[str, Any]) -> str:
    return (f"{_ratio(r.get('itl_interference_p50_ratio'))} / "
            f"{_ratio(r.get('itl_interference_p99_ratio'))}")


def _vs(cand: dict[str, Any], base: dict[str, Any], key: str) -> str:
    return (f"{_ms(cand.get(key))} vs {_ms(base.get(key))} "
            f"({_pct(change(cand.get(key), base.get(key)))})")


def verdict(results: Mapping[str, dict[str, Any]]) -> str:
    """The last system against each earlier one: p99 ITL, max ITL, median TTFT, interference
    ratios, failures."""
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
            f"TTFT p50 {_pct(change(cand.get('median_ttft_ms'), base.get('median_ttft_ms')))}, "
            f"interference p50 / p99 {_ratios(cand)} vs {_ratios(base)}")
    failed = sum(r.get("failed", 0) for r in results.values())
    tail = f"; {failed} failed requests in all" if failed else ""
    return f"{cand_name} " + "; ".join(parts) + tail


def stalls_removed(disagg: dict[str, Any], unchunked: dict[str, Any],
                   target_pct: float = STALL_TARGET_PCT) -> bool:
    """(a): max ITL and p99.9 ITL both at least `target_pct` % below the unchunked baseline's."""
    changes = [change(disagg.get(k), unchunked.get(k)) for k in ("max_itl_ms", "p999_itl_ms")]
    return all(c is not None and c <= -target_pct for c in changes)


def interference_removed(disagg: dict[str, Any], target: float = INTERFERENCE_TARGET) -> bool:
    """(b): the interference ratio at p50 and at p99 both at most `target`."""
    ratios = [disagg.get(f"itl_interference_{q}_ratio") for q in ("p50", "p99")]
    return all(r is not None and r <= target for r in ratios)


def price_ratio(disagg: dict[str, Any], unchunked: dict[str, Any]) -> float | None:
    """1P+1D's TTFT p50 over unchunked colocated's (None when either is missing)."""
    new, old = disagg.get("median_ttft_ms"), unchunked.get("median_ttft_ms")
    return None if new is None or not old else new / old


def price_met(disagg: dict[str, Any], unchunked: dict[str, Any],
              target: float = PRICE_TARGET) -> bool:
    """(e): 1P+1D's TTFT p50 at most `target` times unchunked colocated's."""
    ratio = price_ratio(disagg, unchunked)
    return ratio is not None and ratio <= target


def demo_verdict(unchunked: dict[str, Any], chunked: dict[str, Any],
                 disagg: dict[str, Any] | None) -> str:
    """The demo's claim, one line per part: (a) stalls removed (max ITL and p99.9 ≥ 90 % below
    unchunked), (b) interference removed (1P+1D's ratio ≤ 1.2 at p50 and p99, beside both
    baselines'), (c) the tail against chunked (no target), (d) the TTFT price in full (no
    target), (e) the price's target (1P+1D's TTFT p50 ≤ 1.1 × unchunked colocated's). MET means
    (a), (b) and (e) hold on a 1P+1D run in which every request completed."""
    if disagg is None:
        return ("VERDICT: no disaggregated arm ran; interference ratio p50 / p99: chunked "
                f"{_ratios(chunked)}, unchunked {_ratios(unchunked)}")
    a, b = stalls_removed(disagg, unchunked), interference_removed(disagg)
    e = price_met(disagg, unchunked)
    failed = disagg.get("failed", 0)
    held = {True: "met", False: "missed"}
    head = ("MET" if a and b and e and not failed else "NOT MET") + (
        f" ({failed} 1P+1D requests failed)" if failed else "")
    long_ttft = [r.get("by_kind", {}).get("long", {}).get("median_ttft_ms")
                 for r in (disagg, unchunked, chunked)]
    return "\n".join((
        f"VERDICT: {head}: (a) stalls removed {held[a]}, (b) interference removed {held[b]}, "
        f"(e) price {held[e]}",
        f"  (a) stalls, 1P+1D vs unchunked (target: >= {STALL_TARGET_PCT:.0f} % lower): "
        f"max ITL {_vs(disagg, unchunked, 'max_itl_ms')}, "
        f"p99.9 {_vs(disagg, unchunked, 'p999_itl_ms')}",
        "  (b) interference, ITL during a long prefill / outside one, p50 / p99 (target: 1P+1D "
        f"<= {INTERFERENCE_TARGET} each): 1P+1D {_ratios(disagg)}; chunked {_ratios(chunked)}; "
        f"unchunked {_ratios(unchunked)}",
        f"  (c) tail, 1P+1D vs chunked (no target): p99 {_vs(disagg, chunked, 'p99_itl_ms')}, "
        f"p99.9 {_vs(disagg, chunked, 'p999_itl_ms')}, max {_vs(disagg, chunked, 'max_itl_ms')}",
        f"  (d) price, 1P+1D TTFT p50 {_vs(disagg, unchunked, 'median_ttft_ms')} unchunked, "
        f"vs {_ms(chunked.get('median_ttft_ms'))} chunked "
        f"({_pct(change(disagg.get('median_ttft_ms'), chunked.get('median_ttft_ms')))}); "
        f"p99 {_vs(disagg, unchunked, 'p99_ttft_ms')} unchunked, vs "
        f"{_ms(chunked.get('p99_ttft_ms'))} chunked "
        f"({_pct(change(disagg.get('p99_ttft_ms'), chunked.get('p99_ttft_ms')))}); long "
        f"prompts' TTFT p50 {_ms(long_ttft[0])} vs {_ms(long_ttft[1])} unchunked, "
        f"{_ms(long_ttft[2])} chunked",
        f"  (e) price, 1P+1D TTFT p50 / unchunked's (target: <= {PRICE_TARGET}): "
        f"{_ratio(price_ratio(disagg, unchunked))}",
    ))
