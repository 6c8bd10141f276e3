"""Prompt tokens computed against cached, as the servers report them.

Per request (`prefix_cache_stats`): vLLM's completions `usage.prompt_tokens_details.
cached_tokens`, sent when the server runs with `--enable-prompt-tokens-details` (the prompt
tokens the answering engine did not compute: its prefix-cache hits plus KV loaded through a
connector). Over the successful requests that reported it: `cached_prompt_tokens`,
`computed_prompt_tokens` (their prompt tokens − cached) and `prefix_hit_rate` (cached / prompt
tokens); all null when no request reported it. Behind a P/D router the figure is what the
router passes on from the engine that answered.

Per worker (`read_prompt_sources` at the run's start and stop, `source_deltas`): vLLM's counter
`vllm:prompt_tokens_by_source` (always on) split into `computed` (`local_compute`), `cache_hit`
(`local_cache_hit`) and `loaded` (`external_kv_transfer`: KV that came through a connector),
over the run, with the worker's `hit_rate` = cache_hit / all three. `role_totals` sums them per
role (the name's part before its first `:`, as `cli.discover_workers` names workers) and over
all workers (`prompt_tokens_computed`, `..._cache_hit`, `..._loaded`, `worker_hit_rate`). Behind
P/D both P's and D's prompt tokens count (D's prompt is P's plus the first token). The run
reads them after its warm-up requests are answered.

From the router (`read_router_counters` on the endpoint's `/metrics` at the run's start and
stop, `router_deltas`; an endpoint without splitserve's router families gives nulls):
`kv_bytes_moved` and `kv_transfers` (the sum and count of `splitserve_router_kv_bytes`: the KV
bytes D received per request), `local_prefills` (requests run whole on D), and per worker URL
(`cache_prediction`) the prefix tokens the router predicted cached (`predicted`: every P leg,
and D's under prefill on D), the engine-reported cached tokens (`reported`: P legs whose answer
carried `usage.prompt_tokens_details.cached_tokens`), the prediction for those same legs
(`predicted_reported`) and `error` = |predicted_reported − reported| / reported; summed as
`predicted_cached_tokens`, `reported_cached_tokens` and `prediction_error`. An error is null
when nothing was reported (0 when neither side saw a cached token). `index_lag_s`: the mean of
`splitserve_router_kv_event_lag_seconds` over the run (how long after a worker stamped a cache
change the router's index applied it; null when it applied none). A counter lower at the stop
than at the start (the router restarted) counts from zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.client import RequestRecord
from splitserve.config import bearer_headers

PROMPT_SOURCES = "vllm:prompt_tokens_by_source_total"
SOURCE_NAMES = {"local_compute": "computed", "local_cache_hit": "cache_hit",
                "external_kv_transfer": "loaded"}


def prefix_cache_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The result JSON's per-request cache keys (see the module docstring)."""
    told = [r for r in records if r.ok and r.cached_tokens is not None]
    prompt = sum(r.input_len for r in told)
    cached = sum(int(r.cached_tokens or 0) for r in told)
    return {"cache_reported_requests": len(told),
            "cached_prompt_tokens": cached if told else None,
            "computed_prompt_tokens": prompt - cached if told else None,
            "prefix_hit_rate": cached / prompt if told and prompt else None}


def parse_prompt_sources(metrics_text: str) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source` per source (our names), summed over engines."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(PROMPT_SOURCES + "{"):
            continue
        labels, _, value = line[len(PROMPT_SOURCES) + 1:].rpartition("} ")
        for part in labels.split(","):
            key, _, val = part.partition("=")
            if key.strip() == "source" and val.strip('"') in SOURCE_NAMES:
                name = SOURCE_NAMES[val.strip('"')]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
    return out


async def read_prompt_sources(worker_urls: Mapping[str, str], token: str | None = None
                              ) -> dict[str, dict[str, float]]:
    """Each worker's counters now (workers that do not answer, or lack it, are left out)."""
    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=5.0, headers=bearer_headers(token)) as client:
        for name, url in worker_urls.items():
            try:
                resp = await client.get(f"{url.rstrip('/')}/metrics")
            except httpx.HTTPError:
                continue
            if resp.status_code == 200 and (found := parse_prompt_sources(resp.text)):
                out[name] = found
    return out


def source_deltas(before: Mapping[str, Mapping[str, float]],
                  after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per worker read at both ends: the run's computed / cache-hit / loaded prompt tokens and
    its hit rate (null when it saw no prompt tokens)."""
    out: dict[str, dict[str, Any]] = {}
    for name, end in after.items():
        if name not in before:
            continue
        d: dict[str, Any] = {k: end.get(k, 0.0) - before[name].get(k, 0.0)
                             for k in SOURCE_NAMES.values()}
        total = sum(d.values())
        d["hit_rate"] = d["cache_hit"] / total if total > 0 else None
        out[name] = d
    return out


def role_totals(sources: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """`source_deltas`' per-worker figures summed per role (`prompt_tokens_by_role`) and over
    every worker (see the module docstring); all null when no worker was read."""
    by_role: dict[str, dict[str, Any]] = {}
    for name, d in sources.items():
        role = by_role.setdefault(name.partition(":")[0],
                                  dict.fromkeys(SOURCE_NAMES.values(), 0.0))
        for k in SOURCE_NAMES.values():
            role[k] += d.get(k) or 0.0
    totals = {k: sum(r[k] for r in by_role.values()) for k in SOURCE_NAMES.values()}
    for r in [*by_role.values(), totals]:
        seen = sum(r[k] for k in SOURCE_NAMES.values())
        r["hit_rate"] = r["cache_hit"] / seen if seen > 0 else None
    return {"prompt_tokens_by_role": by_role,
            "prompt_tokens_computed": round(totals["computed"]) if by_role else None,
            "prompt_tokens_cache_hit": round(totals["cache_hit"]) if by_role else None,
            "prompt_tokens_loaded": round(totals["loaded"]) if by_role else None,
            "worker_hit_rate": totals["hit_rate"] if by_role else None}


ROUTER_KV_BYTES = "splitserve_router_kv_bytes"
ROUTER_LOCAL_PREFILLS = "splitserve_router_local_prefills_total"
ROUTER_CACHED = {"splitserve_router_cached_predicted_tokens_total": "predicted",
                 "splitserve_router_cached_reported_tokens_total": "reported",
                 "splitserve_router_cached_predicted_reported_tokens_total":
                     "predicted_reported"}
ROUTER_KV_LAG = "splitserve_router_kv_event_lag_seconds"
ROUTER_KEYS = ("kv_bytes_moved", "kv_transfers", "local_prefills", "cache_prediction",
               "predicted_cached_tokens", "reported_cached_tokens", "prediction_error",
               "index_lag_s")


@dataclass
class RouterCounters:
    """The router's counters at one moment (see the module docstring)."""

    kv_bytes: float = 0.0
    kv_transfers: float = 0.0
    local_prefills: float = 0.0
    kv_lag_sum: float = 0.0  # seconds, over the index's applied cache changes
    kv_lag_count: float = 0.0
    # worker URL -> {"role": ..., "predicted" / "reported" / "predicted_reported": tokens}
    cached: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse_router_counters(metrics_text: str) -> RouterCounters | None:
    """The counters in a router's Prometheus text; None when it has no
    `splitserve_router_kv_bytes` family (not splitserve's router) or does not parse."""
    out, found = RouterCounters(), False
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except ValueError:
        return None
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == ROUTER_KV_BYTES + "_sum":
                out.kv_bytes, found = value, True
            elif name == ROUTER_KV_BYTES + "_count":
                out.kv_transfers = value
            elif name == ROUTER_LOCAL_PREFILLS:
                out.local_prefills += value
            elif name == ROUTER_KV_LAG + "_sum":
                out.kv_lag_sum = value
            elif name == ROUTER_KV_LAG + "_count":
                out.kv_lag_count = value
            elif name in ROUTER_CACHED and "url" in labels:
                worker = out.cached.setdefault(labels["url"], {"role": labels.get("role")})
                worker[ROUTER_CACHED[name]] = worker.get(ROUTER_CACHED[name], 0.0) + value
    return out if found else None


async def read_router_counters(url: str, api_key: str | None = None) -> RouterCounters | None:
    """The router's counters now (None when `url`/metrics does not answer with them)."""
    try:
        async with httpx.AsyncClient(timeout=5.0, headers=bearer_headers(api_key)) as client:
            resp = await client.get(f"{url.rstrip('/')}/metrics")
    except httpx.HTTPError:
        return None
    return parse_router_counters(resp.text) if resp.status_code == 200 else None


def _delta(before: float, after: float) -> float:
    return after - before if after >= before else after  # lower: the router restarted


def _error(predicted: float, reported: float) -> float | None:
    if reported > 0:
        return abs(predicted - reported) / reported
    return 0.0 if predicted == 0 else None


def router_deltas(before: RouterCounters | None, after: RouterCounters | None
                  ) -> dict[str, Any]:
    """The result keys `ROUTER_KEYS` over the run (all null unless both reads succeeded)."""
    if before is None or after is None:
        return dict.fromkeys(ROUTER_KEYS)
    per: dict[str, dict[str, Any]] = {}
    kinds = tuple(ROUTER_CACHED.values())
    for url, end in after.cached.items():
        start = before.cached.get(url, {})
        d: dict[str, Any] = {"role": end.get("role")}
        d |= {k: _delta(start.get(k, 0.0), end.get(k, 0.0)) for k in kinds}
        d["error"] = _error(d["predicted_reported"], d["reported"]) if "reported" in end \
            else None
        per[url] = d
    predicted = sum(d["predicted_reported"] for d in per.values())
    reported = sum(d["reported"] for d in per.values())
    any_reported = any("reported" in end for end in after.cached.values())
    lags = _delta(before.kv_lag_count, after.kv_lag_count)
    lag = _delta(before.kv_lag_sum, after.kv_lag_sum) / lags if lags > 0 else None
    return {"kv_bytes_moved": round(_delta(before.kv_bytes, after.kv_bytes)),
            "kv_transfers": round(_delta(before.kv_transfers, after.kv_transfers)),
            "local_prefills": round(_delta(before.local_prefills, after.local_prefills)),
            "cache_prediction": per,
            "predicted_cached_tokens": round(predicted) if any_reported else None,
            "reported_cached_tokens": round(reported) if any_reported else None,
            "prediction_error": _error(predicted, reported) if any_reported else None,
            "index_lag_s": lag}
