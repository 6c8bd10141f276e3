"""The router's Prometheus families, in a registry owned by one app (no process globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


class WorkerCollector:
    """Per-worker families read from the registry at scrape time, labelled `role`, `url` and
    `node` (where the launcher named one, e.g. the Ray node id; empty otherwise):
    `splitserve_router_worker_routable` (1 while it takes new requests) and
    `splitserve_router_worker_inflight` (the router's open legs on it)."""

    def __init__(self, workers: Callable[[], Iterable[Any]]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url", "node"]
        routable = GaugeMetricFamily("splitserve_router_worker_routable",
                                     "1 while the worker takes new requests", labels=labels)
        inflight = GaugeMetricFamily("splitserve_router_worker_inflight",
                                     "The router's open legs on the worker", labels=labels)
        for w in list(self.workers()):
            values = [w.pool.value, w.url, w.identity.node or ""]
            routable.add_metric(values, 1.0 if w.routable else 0.0)
            inflight.add_metric(values, float(w.accounting.inflight))
        yield routable
        yield inflight


class CacheCollector:
    """The cache view's families, read at scrape time: per worker (labels `role`, `url`,
    `node`) `splitserve_router_worker_kv_synced` (1 while its view is exact; 0: routed by
    load), `..._kv_blocks` and `..._kv_tokens` (what the index holds of it), and
    `..._kv_lag_seconds` (its last change: applied at the router - stamped by the worker);
    the whole index's `splitserve_router_kv_index_blocks` (distinct) and `..._bytes`
    (blocks x the measured bytes per block)."""

    def __init__(self, workers: Callable[[], Iterable[Any]],
                 describe: Callable[[str], dict[str, Any] | None],
                 size: Callable[[], tuple[int, int]]) -> None:
        self.workers, self.view_of, self.size = workers, describe, size

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "url", "node"]
        synced = GaugeMetricFamily("splitserve_router_worker_kv_synced",
                                   "1 while the router's view of the worker's cache is exact "
                                   "(0: its cached tokens are unknown, it is routed by load)",
                                   labels=labels)
        blocks = GaugeMetricFamily("splitserve_router_worker_kv_blocks",
                                   "Cached prefix blocks the router's index holds for the "
                                   "worker", labels=labels)
        tokens = GaugeMetricFamily("splitserve_router_worker_kv_tokens",
                                   "Cached prefix tokens the router's index holds for the "
                                   "worker", labels=labels)
        lag = GaugeMetricFamily("splitserve_router_worker_kv_lag_seconds",
                                "The worker's last cache change: applied here - stamped there",
                                labels=labels)
        for w in list(self.workers()):
            values = [w.pool.value, w.url, w.identity.node or ""]
            view = self.view_of(w.url) or {}
            synced.add_metric(values, 1.0 if view.get("synced") else 0.0)
            blocks.add_metric(values, float(view.get("blocks") or 0))
            tokens.add_metric(values, float(view.get("tokens") or 0))
            if view.get("lag_s") is not None:
                lag.add_metric(values, float(view["lag_s"]))
        n, nbytes = self.size()
        yield synced
        yield blocks
        yield tokens
        yield lag
        yield GaugeMetricFamily("splitserve_router_kv_index_blocks",
                                "Distinct blocks in the router's cache index", value=n)
        yield GaugeMetricFamily("splitserve_router_kv_index_bytes",
                                "The cache index's memory (blocks x measured bytes per block)",
                                value=nbytes)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "splitserve_router_requests", "Requests by endpoint, path and outcome",
            ["endpoint", "mode", "outcome"], registry=r)
        self.inflight = Gauge("splitserve_router_inflight_requests", "Open client requests",
                              registry=r)
        self.failures = Counter(
            "splitserve_router_failures", "Leg failures by leg and cause (retried or not)",
            ["leg", "cause"], registry=r)
        self.retries = Counter("splitserve_router_retries", "Legs retried on another worker",
                               ["leg"], registry=r)
        self._timing_families(r)
        self._cache_families(r)

    def _timing_families(self, r: CollectorRegistry) -> None:
        """The per-request timing histograms (`observe_timings`)."""
        self.p_queue = Histogram(
            "splitserve_router_prefill_queue_seconds",
            "P leg sent -> first KV byte at D (P's queue plus one layer)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.p_leg = Histogram(
            "splitserve_router_prefill_seconds", "P leg sent -> t1 back at the router",
            buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes = Histogram("splitserve_router_kv_bytes", "KV bytes moved per request",
                                  buckets=BYTES_BUCKETS, registry=r)
        self.kv_seconds = Histogram(
            "splitserve_router_kv_transfer_seconds", "KV transfer BEGIN -> verified END",
            buckets=LATENCY_BUCKETS, registry=r)
        self.kv_gbps = Histogram("splitserve_router_kv_gbps",
                                 "KV wire rate per request (bytes / seconds in flight)",
                                 buckets=GBPS_BUCKETS, registry=r)
        self.handover = Histogram(
            "splitserve_router_handover_seconds", "t1 sent to the client -> t2 sent",
            buckets=LATENCY_BUCKETS, registry=r)
        self.d_first = Histogram(
            "splitserve_router_decode_queue_seconds",
            "D leg sent -> first D token (D's queue, KV load and one step)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.d_wait = Histogram(
            "splitserve_router_decode_wait_seconds",
            "D leg sent -> D's scheduler takes it into a step (D's intake and the wait for its "
            "step in progress; D's clock against the router's)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("splitserve_router_ttft_seconds",
                              "Request received -> first token sent", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("splitserve_router_e2e_seconds", "Request received -> last byte",
                             buckets=LATENCY_BUCKETS, registry=r)

    def _cache_families(self, r: CollectorRegistry) -> None:
        """The cache view's and cache-aware routing's families."""
        self.kv_event_lag = Histogram(
            "splitserve_router_kv_event_lag_seconds",
            "A worker's cache change: applied to the router's index - stamped by the worker",
            buckets=LATENCY_BUCKETS, registry=r)
        self.kv_resyncs = Counter(
            "splitserve_router_kv_resyncs",
            "Views of a worker's cache forgotten and rebuilt from a snapshot, by reason (gone: "
            "410, the router fell behind; gap; epoch; restart; lost: the stream failed)",
            ["url", "reason"], registry=r)
        self.kv_unsynced_picks = Counter(
            "splitserve_router_kv_unsynced_picks",
            "Picks (by pool) where a candidate's cache was unknown (its view not synced): it "
            "was scored by load", ["pool"], registry=r)
        self.cached_predicted = Counter(
            "splitserve_router_cached_predicted_tokens",
            "Prompt tokens the router predicted the worker's prefix cache would serve, per leg "
            "sent (P legs; D's whole requests under prefill on D)", ["role", "url"],
            registry=r)
        self.cached_reported = Counter(
            "splitserve_router_cached_reported_tokens",
            "Prompt tokens the engine reported served from its cache (usage.prompt_tokens_"
            "details.cached_tokens: workers run with --enable-prompt-tokens-details)",
            ["role", "url"], registry=r)
        self.cached_predicted_reported = Counter(
            "splitserve_router_cached_predicted_reported_tokens",
            "The router's prediction for the legs whose engine reported its cached tokens: "
            "compare with splitserve_router_cached_reported_tokens", ["role", "url"],
            registry=r)
        self.local_prefills = Counter(
            "splitserve_router_local_prefills",
            "Requests run whole on the D that held all but --local-prefill-max-tokens of the "
            "prompt (prefill on D: no P leg, no transfer)", ["url"], registry=r)
        self.local_prefill_tokens = Counter(
            "splitserve_router_local_prefill_tokens",
            "Prompt tokens D computed itself under prefill on D (prompt - its cached prefix)",
            ["url"], registry=r)

    def watch_workers(self, workers: Callable[[], Iterable[Any]]) -> None:
        """Export the per-worker families of `WorkerCollector` over `workers()`."""
        self.registry.register(WorkerCollector(workers))

    def watch_cache(self, workers: Callable[[], Iterable[Any]],
                    describe: Callable[[str], dict[str, Any] | None],
                    size: Callable[[], tuple[int, int]]) -> None:
        """Export the cache view's families (`CacheCollector`)."""
        self.registry.register(CacheCollector(workers, describe, size))

    def observe_timings(self, t: dict[str, Any]) -> None:
        """Record one request's per-leg timings (keys as in `flow.Timings.as_dict`)."""
        pairs = ((self.p_queue, "p_queue_s"), (self.p_leg, "p_leg_s"),
                 (self.kv_bytes, "kv_bytes"), (self.kv_seconds, "kv_transfer_s"),
                 (self.kv_gbps, "kv_gbps"), (self.handover, "handover_s"),
                 (self.d_first, "d_queue_s"), (self.d_wait, "d_wait_s"), (self.ttft, "ttft_s"),
                 (self.e2e, "e2e_s"))
        for hist, key in pairs:
            value = t.get(key)
            if isinstance(value, int | float):
                hist.observe(value)
