"""A simulated run written in the benchmark's result schema (vLLM `bench serve` key names), and
SLO attainment.

Definitions follow vLLM: TTFT = first token − send; TPOT = (E2EL − TTFT) / (output − 1) for
requests with more than one output token; ITL = every gap between consecutive tokens, pooled over
requests (one token per streamed chunk), percentiles by linear interpolation (`np.percentile`);
duration = last completion − start of the run. Failed requests are counted in `failed` and are
misses for attainment.

ITL is pooled without materialising every gap: a decode segment contributes its step durations
with the batch size as weight, and each request's handover gap (t2 − t1) counts once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splitserve.bench.metrics import SLO, STATS
from splitserve.sim.deployment import SimOutcome

SCHEMA = "splitserve.bench/1"

PERCENTILES = (50.0, 90.0, 99.0)


def weighted_percentiles(values: np.ndarray, weights: np.ndarray,
                         ps: tuple[float, ...] = PERCENTILES) -> dict[float, float]:
    """np.percentile of the multiset where values[i] appears weights[i] times (integer
    weights), without expanding it."""
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if len(values) == 0:
        return {p: float("nan") for p in ps}
    order = np.argsort(values, kind="stable")
    v, cw = values[order], np.cumsum(weights[order])
    n = int(cw[-1])
    out = {}
    for p in ps:
        pos = p / 100.0 * (n - 1)
        lo, hi = int(np.floor(pos)), int(np.ceil(pos))
        vlo = v[np.searchsorted(cw, lo, side="right")]
        vhi = v[np.searchsorted(cw, hi, side="right")]
        out[p] = float(vlo + (vhi - vlo) * (pos - lo))
    return out


EXACT_STEPS = 2_000_000  # expand every decode step up to this many; compress beyond
BLOCKS = 8


def _segment_steps(o: SimOutcome) -> tuple[np.ndarray, np.ndarray]:
    """(step durations, gaps per step) of every decode segment. Exact when the run has at most
    EXACT_STEPS steps; otherwise the steps after the first of a segment longer than BLOCKS
    steps are cut into BLOCKS runs of consecutive steps, each stood for by its mean duration
    (exact for the mean, since a segment's step time is linear in the step; off by at most
    β·k/(2·BLOCKS) per step)."""
    k, alpha, beta = o.seg_k, o.seg_alpha, o.seg_beta
    batch, new = o.seg_batch, o.seg_new
    if int(k.sum()) <= EXACT_STEPS:
        return _expand(alpha, beta, k, batch, new)
    small = k <= BLOCKS
    v_small, w_small = _expand(alpha[small], beta[small], k[small], batch[small], new[small])
    big = ~small
    rest = k[big][:, None] - 1  # steps after the first, which stands alone (it has `new`)
    b = np.arange(BLOCKS)[None, :]
    lo, hi = 1 + (b * rest) // BLOCKS, ((b + 1) * rest) // BLOCKS
    vals = alpha[big][:, None] + beta[big][:, None] * (lo + hi) / 2
    wts = (hi - lo + 1) * batch[big][:, None]
    return (np.concatenate([v_small, alpha[big], vals.ravel()]),
            np.concatenate([w_small, batch[big] - new[big], wts.ravel()]))


def _expand(alpha: np.ndarray, beta: np.ndarray, k: np.ndarray, batch: np.ndarray,
            new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.repeat(np.arange(len(k)), k)
    starts = np.cumsum(k) - k
    j = np.arange(int(k.sum())) - np.repeat(starts, k)
    w = batch[idx].copy()
    w[starts[k > 0]] -= new[k > 0]
    return alpha[idx] + beta[idx] * j, w


def itl_samples(o: SimOutcome) -> tuple[np.ndarray, np.ndarray]:
    """(values, weights) of the pooled inter-token gaps, in seconds."""
    steps, w = _segment_steps(o)
    multi = (o.output_lens > 1) & ~o.failed
    hand = (o.second_token - o.first_token)[multi]
    if o.gap_jitter_s:  # each step gap spread over the measured jitter (seconds added)
        shift = np.array([s for s, _ in o.gap_jitter_s])
        permille = np.array([w for _, w in o.gap_jitter_s], dtype=np.int64)
        steps = np.maximum(steps[:, None] + shift[None, :], 0.0).ravel()
        w = np.outer(w, permille).ravel()
        return (np.concatenate([steps, hand]),
                np.concatenate([w, np.full(len(hand), int(permille.sum()), dtype=np.int64)]))
    return (np.concatenate([steps, hand]),
            np.concatenate([w, np.ones(len(hand), dtype=np.int64)]))


def _stats(prefix: str, values_s: np.ndarray, weights: np.ndarray | None = None
           ) -> dict[str, float | None]:
    """`{stat}_{prefix}_ms` for the benchmark's STATS; None for an empty set (as the bench)."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    wts = np.ones(len(ms), dtype=np.int64) if weights is None else weights
    tot = int(wts.sum())
    if tot == 0:
        return {f"{stat}_{prefix}_ms": None for stat in STATS}
    mean = float((ms * wts).sum() / tot)
    pct = weighted_percentiles(ms, wts, (50.0, 90.0, 99.0, 99.9))
    vals = {"mean": mean, "median": pct[50.0],
            "std": float(np.sqrt((wts * (ms - mean) ** 2).sum() / tot)),
            "p90": pct[90.0], "p99": pct[99.0], "p999": pct[99.9],
            "max": float(ms[wts > 0].max())}
    return {f"{stat}_{prefix}_ms": vals[stat] for stat in STATS}


def _max_concurrent(start: np.ndarray, end: np.ndarray) -> int:
    times = np.concatenate([start, end])
    delta = np.concatenate([np.ones(len(start)), -np.ones(len(end))])
    order = np.lexsort((delta, times))  # ends before starts at equal times
    return int(np.cumsum(delta[order]).max(initial=0))


def summarize(o: SimOutcome, system: str = "sim", slo: SLO | None = None,
              per_request: bool = False) -> dict[str, Any]:
    """The benchmark's result keys for a simulated run (`simulated: true`)."""
    ok = ~o.failed & np.isfinite(o.finish)
    dur = float(np.nanmax(o.finish)) if ok.any() else 0.0
    ttft = o.first_token[ok] - o.arrivals[ok]
    e2el = o.finish[ok] - o.arrivals[ok]
    multi = ok & (o.output_lens > 1)
    tpot = (o.finish[multi] - o.first_token[multi]) / (o.output_lens[multi] - 1)
    iv, iw = itl_samples(o)
    out_tok = int(o.output_lens[ok].sum())
    in_tok = int(o.prompt_lens[ok].sum())
    n = len(o.arrivals)
    slo = slo or SLO()
    att = None if slo.empty else attainment(
        o, (slo.ttft_ms or float("inf")) / 1000, (slo.tpot_ms or float("inf")) / 1000)
    res: dict[str, Any] = {
        "schema": SCHEMA, "system": system, "simulated": True,
        "duration": dur, "num_prompts": n, "completed": int(ok.sum()),
        "failed": int((~ok).sum()), "error_rate": float((~ok).sum() / n),
        "errors": {"kv_capacity": int((~ok).sum())} if (~ok).any() else {},
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": float(ok.sum() / dur) if dur else 0.0,
        "request_goodput": att * n / dur if att is not None and dur else None,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "slo_attainment": att,
        "output_throughput": out_tok / dur if dur else 0.0,
        "total_token_throughput": (in_tok + out_tok) / dur if dur else 0.0,
        "max_concurrent_requests": _max_concurrent(o.arrivals[ok], o.finish[ok]),
        "sim_events": o.events,
    }
    res |= _stats("ttft", ttft) | _stats("tpot", tpot) | _stats("itl", iv, iw)
    res |= _stats("e2el", e2el) | _stats("handover", (o.second_token - o.first_token)[multi])
    res |= kv_stats(o)
    res |= cache_stats(o, ok)
    if per_request:
        res |= {"input_lens": o.prompt_lens.tolist(), "output_lens": o.output_lens.tolist(),
                "ttfts": (o.first_token - o.arrivals).tolist(),
                "start_times": o.arrivals.tolist()}
    return res


def kv_stats(o: SimOutcome) -> dict[str, float]:
    """The benchmark's KV keys (`bench.metrics.compute_metrics`: mean, median and p99 of the
    server's timings behind splitserve's router) over the requests that crossed a link:
    `*_kv_transfer_ms`, the transfer's span (BEGIN → END), and `*_kv_tail_ms`, its exposed tail
    after P's prefill. Left out without a transfer, as the benchmark leaves them out."""
    out: dict[str, float] = {}
    for name, values in (("kv_transfer", o.kv_transfer_s), ("kv_tail", o.kv_tail_s)):
        v = values[np.isfinite(values)]
        if len(v):
            out |= {f"mean_{name}_ms": float(v.mean() * 1000),
                    f"median_{name}_ms": float(np.median(v) * 1000),
                    f"p99_{name}_ms": float(np.percentile(v, 99) * 1000)}
    return out


def attainment(o: SimOutcome, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Share of all requests that completed with TTFT and TPOT within their SLOs (a request with
    one output token has no TPOT and meets it)."""
    ok = ~o.failed & np.isfinite(o.finish)
    ttft = o.first_token - o.arrivals
    multi = o.output_lens > 1
    tpot = np.where(multi, (o.finish - o.first_token) / np.maximum(o.output_lens - 1, 1), 0.0)
    good = ok & (ttft <= ttft_slo_s) & (tpot <= tpot_slo_s)
    return float(good.sum() / len(good))


def cache_stats(o: SimOutcome, ok: np.ndarray) -> dict[str, Any]:
    """The benchmark's prefix-cache keys over the completed requests (`bench.cachestats`: the
    computing engine's cached prompt tokens, as vLLM reports them), the KV bytes that crossed to
    D and the requests prefilled on D; and the engine-seconds spent in steps that prefill
    (`prefill_engine_s`) and GPU-seconds (`prefill_gpu_s`: each engine's times its TP). All
    cache keys null without prefix caches."""
    out: dict[str, Any] = {"prefill_engine_s": o.prefill_busy_s,
                           "prefill_gpu_s": o.prefill_gpu_s}
    if o.cached_tokens is None or o.local is None or o.kv_bytes is None:
        return out | dict.fromkeys(("cached_prompt_tokens", "computed_prompt_tokens",
                                    "prefix_hit_rate", "kv_bytes_moved", "local_prefills"))
    prompt = int(o.prompt_lens[ok].sum())
    cached = int(o.cached_tokens[ok].sum())
    return out | {"cached_prompt_tokens": cached, "computed_prompt_tokens": prompt - cached,
                  "prefix_hit_rate": cached / prompt if prompt else None,
                  "kv_bytes_moved": int(o.kv_bytes[ok].sum()),
                  "local_prefills": int(o.local[ok].sum())}
