"""One benchmark run, repeats and rate sweeps: stream → client → metrics → result dict.

A result dict is the JSON written by `splitserve bench` (schema `splitserve.bench/1`):
vLLM's `bench serve` keys at the top level (see metrics.py), plus `system`, `busy_fraction`
(per worker), `run_sheet`, `requests` (the raw per-request records), and, when asked for,
`repeats` + `spread` (the top-level metrics are then those of the first repeat) or `sweep`
(points per rate and `distserve_goodput`; the top-level metrics are those of the highest rate).
`busy_fraction` / `queued_fraction`: per worker, the share of `/metrics` samples with a request
running or waiting / with a request waiting (see client.BusySampler). `nixl_transfers` (only
when vLLM's NixlConnector moved KV): per worker, its transfers' count, mean duration, post time
and bytes over the run, from vLLM's `vllm:nixl_*` histograms. `spec_decode` (only when a
worker drafted: speculative decoding on D or colocated): per worker, its drafts, draft tokens,
accepted tokens, acceptance rate and accepted tokens per draft over the run, from vLLM's
`vllm:spec_decode_*` counters; their totals as `spec_drafts`, `spec_draft_tokens`,
`spec_accepted_tokens`, `spec_acceptance_rate`, `spec_accepted_per_draft`.
Prefix reuse: `ideal_reuse` (+ `ideal_reused_tokens`, `ideal_computed_tokens`; repeat.py) for
the `mooncake` (over the stream) and `multiturn` (over the prompts sent) workloads, null for the
others (their prompts are random: nothing repeats); the server-reported `prefix_hit_rate`,
`cached_prompt_tokens`, `computed_prompt_tokens` (metrics via cachestats.py) and, per worker,
`prompt_tokens_by_source` (computed / cache_hit / loaded over the run, and its hit rate), the
same per role (`prompt_tokens_by_role`) and over all workers (`prompt_tokens_computed`,
`prompt_tokens_cache_hit`, `prompt_tokens_loaded`, `worker_hit_rate`); from the router's
`/metrics` at the run's start and stop, `kv_bytes_moved`, `kv_transfers`, `local_prefills`,
`cache_prediction` (per worker) and `predicted_cached_tokens` / `reported_cached_tokens` /
`prediction_error` (all null behind an endpoint that is not splitserve's router; cachestats.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from splitserve.bench.cachestats import (
    read_prompt_sources,
    read_router_counters,
    role_totals,
    router_deltas,
    source_deltas,
)
from splitserve.bench.client import (
    BusySampler,
    ClientConfig,
    RequestRecord,
    http_client,
    run_stream,
    spec_rates,
    warm_up,
)
from splitserve.bench.metrics import SLO, compute_metrics, distserve_goodput, spread
from splitserve.bench.repeat import IdealReuse, ideal_reuse_blocks
from splitserve.bench.runsheet import run_sheet
from splitserve.bench.workload import Request, WorkloadSpec, build_stream, build_warmup

SCHEMA = "splitserve.bench/1"
ProgressFactory = Callable[[str, int], Callable[[RequestRecord], None]]


@dataclass(frozen=True)
class RunOptions:
    """Everything about a run that is not the workload or the endpoint."""

    slo: SLO = SLO()
    repeats: int = 1
    sweep_rates: tuple[float, ...] = ()
    busy_sample_s: float = 0.25  # /metrics renders cost the worker CPU: keep it light
    total_cores: int | None = None  # for goodput per core
    # The deployment token, for sampling workers' /metrics (workers require it). Never recorded.
    worker_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if any(r <= 0 for r in self.sweep_rates):
            raise ValueError("sweep rates must be positive")
        if self.total_cores is not None and self.total_cores < 1:
            raise ValueError("total_cores must be >= 1")


def _scalars(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


async def run_once(client: ClientConfig, spec: WorkloadSpec, system: str,
                   deployment: dict[str, Any], worker_metrics: dict[str, str],
                   opts: RunOptions, progress: ProgressFactory | None = None) -> dict[str, Any]:
    """Send `spec`'s stream to `client.url` once and return its result dict."""
    requests, warmup = build_stream(spec), build_warmup(spec)
    async with http_client(client) as http:  # the run goes over the warm-up's connections
        model = await warm_up(http, client, warmup)  # before the counters: not in the result
        client = replace(client, model=model)
        return await _measure(client, spec, requests, system, deployment, worker_metrics, opts,
                              progress, http)


async def _measure(client: ClientConfig, spec: WorkloadSpec, requests: list[Request],
                   system: str, deployment: dict[str, Any], worker_metrics: dict[str, str],
                   opts: RunOptions, progress: ProgressFactory | None, http: httpx.AsyncClient
                   ) -> dict[str, Any]:
    """`run_once` after its warm-up: the counters before, the run over `http`, the counters
    after, and the result."""
    on_done = progress(system, len(requests)) if progress else None
    sources_before = await read_prompt_sources(worker_metrics, opts.worker_token)
    router_before = await read_router_counters(client.url, client.api_key)
    sampler = BusySampler(worker_metrics, opts.busy_sample_s, opts.worker_token)
    sampler.start()
    ideal: IdealReuse | None = None
    try:
        if spec.source == "multiturn":
            from splitserve.bench.multiturn import run_sessions

            records, duration, ideal = await run_sessions(client, spec, requests, on_done,
                                                          http=http)
        else:
            records, duration = await run_stream(client, requests,
                                                 spec.arrival.max_concurrency, on_done, http)
            ideal = stream_ideal_reuse(spec, requests)
    finally:
        busy = await sampler.stop()
    sources = source_deltas(sources_before,
                            await read_prompt_sources(worker_metrics, opts.worker_token))
    router = router_deltas(router_before, await read_router_counters(client.url, client.api_key))
    result: dict[str, Any] = {"schema": SCHEMA, "system": system}
    result |= compute_metrics(records, duration, opts.slo)
    result |= ideal.to_result() if ideal is not None else dict.fromkeys(
        ("ideal_reuse", "ideal_reused_tokens", "ideal_computed_tokens"))
    result["prompt_tokens_by_source"] = sources
    result |= role_totals(sources)
    result |= router
    result["busy_fraction"] = busy
    result["queued_fraction"] = sampler.queued()
    if nixl := sampler.nixl_transfers():
        result["nixl_transfers"] = nixl
    if drafting := sampler.spec_decode():
        result["spec_decode"] = drafting
        total = {k: sum(w[k] for w in drafting.values())
                 for k in ("drafts", "draft_tokens", "accepted_tokens")}
        result |= {f"spec_{k}": v for k, v in (total | spec_rates(total)).items()}
    result["run_sheet"] = run_sheet(spec, requests, client.model, deployment)
    result["requests"] = [r.to_dict() for r in records]
    return result


def stream_ideal_reuse(spec: WorkloadSpec, requests: list[Request]) -> IdealReuse | None:
    """The ideal reuse of an open-loop stream: by hash blocks for `mooncake`, None for the
    sources whose prompts are random."""
    if spec.source != "mooncake":
        return None
    return ideal_reuse_blocks(((r.hash_ids, r.input_len) for r in requests),
                              spec.mooncake.scaled_block_tokens)


async def run_bench(client: ClientConfig, spec: WorkloadSpec, system: str,
                    deployment: dict[str, Any], worker_metrics: dict[str, str] | None = None,
                    opts: RunOptions = RunOptions(), progress: ProgressFactory | None = None,
                    ) -> dict[str, Any]:
    """A run with repeats, or a rate sweep when `opts.sweep_rates` is set."""
    metrics_urls = worker_metrics or {}
    if opts.sweep_rates:
        return await run_sweep(client, spec, system, deployment, metrics_urls, opts, progress)
    runs = []
    for i in range(opts.repeats):
        tagged = replace(client, run_tag=f"{client.run_tag}-r{i}")
        runs.append(await run_once(tagged, spec, system, deployment, metrics_urls, opts,
                                   progress))
    result = runs[0]
    if opts.repeats > 1:
        result["repeats"] = [_scalars(r) for r in runs]
        result["spread"] = spread(result["repeats"])
    return result


async def run_sweep(client: ClientConfig, spec: WorkloadSpec, system: str,
                    deployment: dict[str, Any], worker_metrics: dict[str, str],
                    opts: RunOptions, progress: ProgressFactory | None = None) -> dict[str, Any]:
    """Run the same workload at each rate; attainment per rate and DistServe goodput."""
    if opts.slo.empty:
        raise ValueError("a rate sweep needs an SLO (--slo-ttft-ms and/or --slo-tpot-ms)")
    points: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    for rate in sorted(opts.sweep_rates):
        tagged = replace(client, run_tag=f"{client.run_tag}-rate{rate:g}")
        last = await run_once(tagged, spec.with_rate(rate), f"{system}@{rate:g}",
                              deployment, worker_metrics, opts, progress)
        points.append({"rate": rate} | {k: last.get(k) for k in (
            "slo_attainment", "request_goodput", "request_throughput", "completed", "failed",
            "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms")})
    goodput = distserve_goodput([(p["rate"], p["slo_attainment"]) for p in points])
    if opts.total_cores and goodput["value"] is not None:
        goodput["per_core"] = goodput["value"] / opts.total_cores
    last["system"] = system
    last["sweep"] = {"points": points, "distserve_goodput": goodput, "rate_unit": spec.rate_unit}
    last["distserve_goodput"] = goodput["value"]
    return last


def records_of(result: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in result.get("requests", [])]


def compare_streams(results: Sequence[dict[str, Any]]) -> bool:
    """True when every result ran the identical request stream (same digest)."""
    digests = {r["run_sheet"]["stream"]["digest"] for r in results}
    return len(digests) == 1
