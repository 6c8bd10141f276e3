"""Benchmark metrics, defined as in vLLM's `bench serve` (REFERENCES.md §1, DESIGN.md).

Per request (client clock; a request's clock starts when it is sent):
- TTFT = first streamed chunk − send time; E2EL = last chunk − send time;
- TPOT = (E2EL − TTFT) / (output tokens − 1), only for requests with more than one token;
- ITL = the gaps between consecutive chunks, **per chunk** (a chunk may carry several tokens),
  pooled over all requests before any percentile;
- handover = the first of those gaps (t1 → t2 at the client: the P→D handover when split);
  `*_itl_after_first_ms` are the ITL statistics without it (a diagnostic, not vLLM's ITL).

Interference (ours): a long prompt's prefill window is [send, first chunk] of a request of kind
`long` (the interference workload's long-document class; other workloads have none, and then
the ratios are null); one that failed before its first token keeps [send, end of its response].
Every ITL gap (a, b) of a successful request is "during" when it overlaps any window
(a < window end and b > window start), else "outside"; a request's own gaps all follow its own
window, so only other requests' prefills count. `itl_interference_p{50,99}_ratio` is the ratio
during / outside of the gaps' p50 and p99: 1.0 means decode runs as fast during a long prefill
as outside one.

Prompt tokens cached against computed, as the server reports them: cachestats.py.

Failed requests (any error) are counted in `failed` and `errors`, and count as SLO misses; they
never vanish from the denominators of attainment. Percentiles use numpy's linear interpolation
(as vLLM does). Keys follow vLLM's result JSON where the meaning is the same; ours add p90,
p99.9 (`p999_*`) and max. Statistics of an empty set are `null`.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.cachestats import prefix_cache_stats
from splitserve.bench.client import RequestRecord

STATS = ("mean", "median", "std", "p90", "p99", "p999", "max")
LONG_KIND = "long"  # the request kind whose prefill windows the interference ratio uses
GOODPUT_TARGET = 0.9


@dataclass(frozen=True)
class SLO:
    """Targets in milliseconds; `None` means no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be positive, got {v}")

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None


def output_tokens(rec: RequestRecord) -> int:
    """Tokens the request produced: the server's usage count when given, else the chunks'."""
    return rec.usage_output_tokens if rec.usage_output_tokens is not None else rec.output_tokens


def ttft_s(rec: RequestRecord) -> float | None:
    return rec.chunk_times[0] - rec.send_s if rec.ok and rec.chunk_times else None


def e2el_s(rec: RequestRecord) -> float | None:
    return rec.chunk_times[-1] - rec.send_s if rec.ok and rec.chunk_times else None


def tpot_s(rec: RequestRecord) -> float | None:
    n = output_tokens(rec)
    if not rec.ok or n < 2 or not rec.chunk_times:
        return None
    return (rec.chunk_times[-1] - rec.chunk_times[0]) / (n - 1)


def itls_s(rec: RequestRecord) -> list[float]:
    """Per-chunk gaps of one request (empty for failed requests)."""
    if not rec.ok:
        return []
    t = rec.chunk_times
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def handover_s(rec: RequestRecord) -> float | None:
    gaps = itls_s(rec)
    return gaps[0] if gaps else None


def stats_ms(values_s: Iterable[float], prefix: str) -> dict[str, float | None]:
    """`{stat}_{prefix}_ms` for every stat in STATS, from values in seconds."""
    arr = np.asarray(list(values_s), dtype=float) * 1000.0
    out: dict[str, float | None] = {}
    for stat in STATS:
        key = f"{stat}_{prefix}_ms"
        if arr.size == 0:
            out[key] = None
        elif stat == "mean":
            out[key] = float(np.mean(arr))
        elif stat == "median":
            out[key] = float(np.median(arr))
        elif stat == "std":
            out[key] = float(np.std(arr))
        elif stat == "max":
            out[key] = float(np.max(arr))
        else:
            q = {"p90": 90.0, "p99": 99.0, "p999": 99.9}[stat]
            out[key] = float(np.percentile(arr, q))
    return out


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """A failed request never meets an SLO; a one-token request has no TPOT to miss."""
    if not rec.ok or not rec.chunk_times:
        return False
    t = ttft_s(rec)
    if slo.ttft_ms is not None and (t is None or t * 1000.0 > slo.ttft_ms):
        return False
    p = tpot_s(rec)
    return not (slo.tpot_ms is not None and p is not None and p * 1000.0 > slo.tpot_ms)


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float | None:
    if slo.empty or not records:
        return None
    return sum(meets_slo(r, slo) for r in records) / len(records)


def max_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (send → end of response)."""
    events: list[tuple[float, int]] = []
    for r in records:
        end = max(r.end_s, r.chunk_times[-1] if r.chunk_times else r.send_s)
        if end > r.send_s:
            events += [(r.send_s, 1), (end, -1)]
    peak = cur = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        peak = max(peak, cur)
    return peak


def max_output_tokens_per_s(records: Sequence[RequestRecord]) -> float:
    """The most output tokens delivered in any one-second bucket of the run."""
    buckets: Counter[int] = Counter()
    for r in records:
        if r.ok:
            for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
                buckets[int(t)] += n
    return float(max(buckets.values(), default=0))


def server_timing_stats(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """mean / median / p99 of every numeric per-leg timing the server reported."""
    values: dict[str, list[float]] = {}
    for r in records:
        for k, v in r.server_timings.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                values.setdefault(k, []).append(float(v))
    return {k: {"mean": float(np.mean(v)), "median": float(np.median(v)),
                "p99": float(np.percentile(v, 99)), "count": len(v)}
            for k, v in sorted(values.items())}


def prefill_windows(records: Sequence[RequestRecord]) -> list[tuple[float, float]]:
    """[send, first chunk] of every long prompt, merged where they overlap, in time order (a
    long prompt that failed before its first token: [send, end of its response])."""
    spans = sorted((r.send_s, r.chunk_times[0] if r.chunk_times else max(r.end_s, r.send_s))
                   for r in records if r.kind == LONG_KIND)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def split_gaps(records: Sequence[RequestRecord], windows: Sequence[tuple[float, float]]
               ) -> tuple[list[float], list[float]]:
    """(gaps overlapping a window, gaps overlapping none), per chunk, of successful requests."""
    starts = [s for s, _ in windows]
    during: list[float] = []
    outside: list[float] = []
    for r in records:
        t = r.chunk_times if r.ok else []
        for a, b in zip(t, t[1:], strict=False):
            i = bisect.bisect_left(starts, b) - 1  # the last window starting before b
            (during if i >= 0 and a < windows[i][1] else outside).append(b - a)
    return during, outside


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def interference(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The ITL interference keys: p50 and p99 of the gaps during and outside long prefills
    (ms), their ratios, and the counts on each side (see the module docstring)."""
    windows = prefill_windows(records)
    during, outside = split_gaps(records, windows)
    out: dict[str, Any] = {"itl_interference_long_prompts": sum(
        r.kind == LONG_KIND for r in records)}
    for side, gaps in (("during", during), ("outside", outside)):
        arr = np.asarray(gaps, dtype=float) * 1000.0
        out[f"itl_interference_{side}_count"] = len(gaps)
        out[f"median_itl_{side}_prefill_ms"] = float(np.median(arr)) if gaps else None
        out[f"p99_itl_{side}_prefill_ms"] = float(np.percentile(arr, 99)) if gaps else None
    out["itl_interference_p50_ratio"] = _ratio(out["median_itl_during_prefill_ms"],
                                               out["median_itl_outside_prefill_ms"])
    out["itl_interference_p99_ratio"] = _ratio(out["p99_itl_during_prefill_ms"],
                                               out["p99_itl_outside_prefill_ms"])
    return out


def _kind_stats(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.kind for r in records}):
        group = [r for r in records if r.kind == kind]
        ttfts = [x for x in map(ttft_s, group) if x is not None]
        s = stats_ms(ttfts, "ttft")
        out[kind] = {"count": len(group), "failed": sum(not r.ok for r in group),
                     "mean_ttft_ms": s["mean_ttft_ms"], "median_ttft_ms": s["median_ttft_ms"],
                     "p99_ttft_ms": s["p99_ttft_ms"]}
    return out


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    slo: SLO = SLO()) -> dict[str, Any]:
    """The result JSON's metric keys for one run."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    ok = [r for r in records if r.ok]
    outs = [output_tokens(r) for r in ok]
    in_tok, out_tok = sum(r.input_len for r in ok), sum(outs)
    itls = [g for r in ok for g in itls_s(r)]
    errors = Counter(r.error_cause for r in records if not r.ok)
    met = sum(meets_slo(r, slo) for r in records) if not slo.empty else None
    result: dict[str, Any] = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "errors": dict(sorted(errors.items())),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (met / duration_s) if met is not None else None,
        "output_throughput": out_tok / duration_s,
        "total_token_throughput": (in_tok + out_tok) / duration_s,
        "max_output_tokens_per_s": max_output_tokens_per_s(records),
        "max_concurrent_requests": max_concurrency(records),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "slo_attainment": (met / len(records)) if met is not None and records else None,
    }
    result |= stats_ms([x for x in map(ttft_s, ok) if x is not None], "ttft")
    result |= stats_ms([x for x in map(tpot_s, ok) if x is not None], "tpot")
    result |= stats_ms(itls, "itl")
    result |= stats_ms([x for x in map(e2el_s, ok) if x is not None], "e2el")
    result |= stats_ms([x for x in map(handover_s, ok) if x is not None], "handover")
    # Diagnostic: the pooled ITL without each request's first gap (the handover when split).
    result |= stats_ms([g for r in ok for g in itls_s(r)[1:]], "itl_after_first")
    result |= interference(records)
    result |= prefix_cache_stats(records)
    result["by_kind"] = _kind_stats(records)
    result["server_timings"] = server_timing_stats(records)
    # splitserve's router: kv_transfer_s is BEGIN -> END, kv_tail_s the exposed tail
    for name, keys in (("kv_transfer", ("kv_transfer_ms", "kv_transfer_s")),
                       ("kv_tail", ("kv_tail_s",)), ("d_wait", ("d_wait_s",))):
        for key in keys:
            if key in result["server_timings"]:
                scale = 1000.0 if key.endswith("_s") else 1.0
                st = result["server_timings"][key]
                result[f"mean_{name}_ms"] = st["mean"] * scale
                result[f"median_{name}_ms"] = st["median"] * scale
                result[f"p99_{name}_ms"] = st["p99"] * scale
    # Per-request arrays, as in vLLM's result JSON (failed requests: ttft 0, errors set).
    result["input_lens"] = [r.input_len for r in records]
    result["output_lens"] = [output_tokens(r) if r.ok else 0 for r in records]
    result["ttfts"] = [ttft_s(r) or 0.0 for r in records]
    result["itls"] = [itls_s(r) for r in records]
    result["start_times"] = [r.send_s for r in records]
    result["errors_per_request"] = [r.error or "" for r in records]
    return result


def distserve_goodput(points: Sequence[tuple[float, float]],
                      target: float = GOODPUT_TARGET) -> dict[str, Any]:
    """DistServe goodput from a rate sweep of (rate, attainment) points.

    The highest rate with attainment ≥ target, interpolated linearly between that measured rate
    and the next higher one (which misses the target). If even the highest rate meets it, the
    value is that rate and `bound` is "lower"; if no rate meets it, the value is null.
    """
    pts = sorted(points)
    if not pts:
        raise ValueError("a goodput needs at least one (rate, attainment) point")
    good = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not good:
        return {"value": None, "bound": "below_lowest_rate", "bracket": [None, pts[0][0]],
                "target": target}
    i = good[-1]
    if i == len(pts) - 1:
        return {"value": pts[i][0], "bound": "lower", "bracket": [pts[i][0], None],
                "target": target}
    (r_lo, a_lo), (r_hi, a_hi) = pts[i], pts[i + 1]
    value = r_lo + (a_lo - target) / (a_lo - a_hi) * (r_hi - r_lo)
    return {"value": value, "bound": "interpolated", "bracket": [r_lo, r_hi], "target": target}


def spread(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """mean / std / min / max over repeated runs of every scalar numeric metric."""
    keys = [k for k, v in results[0].items()
            if isinstance(v, int | float) and not isinstance(v, bool)] if results else []
    out: dict[str, dict[str, float]] = {}
    for k in keys:
        vals = [r[k] for r in results if isinstance(r.get(k), int | float)]
        if vals:
            arr = np.asarray(vals, dtype=float)
            out[k] = {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if arr.size > 1
                      else 0.0, "min": float(arr.min()), "max": float(arr.max()), "n": arr.size}
    return out
