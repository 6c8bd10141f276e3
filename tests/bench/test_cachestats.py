"""The router's counters read over a run (KV bytes moved, predicted against engine-reported
cached tokens, prefills on D) and the per-role prompt-token totals: parsed from real Prometheus
text, then differenced. No server needed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import generate_latest

from splitserve.bench.cachestats import (
    ROUTER_KEYS,
    RouterCounters,
    parse_router_counters,
    read_router_counters,
    role_totals,
    router_deltas,
)
from splitserve.bench.report import table_rows
from splitserve.router.metrics import RouterMetrics

P1, P2, D1 = "http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8201"

# as the router's /metrics renders it (prometheus_client 0.x text format), trimmed
ROUTER_PAGE = """\
# HELP splitserve_router_kv_bytes KV bytes moved per request
# TYPE splitserve_router_kv_bytes histogram
splitserve_router_kv_bytes_bucket{le="1024.0"} 0.0
splitserve_router_kv_bytes_bucket{le="+Inf"} 3.0
splitserve_router_kv_bytes_count 3.0
splitserve_router_kv_bytes_sum 3.5e+06
# HELP splitserve_router_kv_bytes_created KV bytes moved per request
# TYPE splitserve_router_kv_bytes_created gauge
splitserve_router_kv_bytes_created 1.7962232940166185e+09
# HELP splitserve_router_cached_predicted_tokens_total Prompt tokens the router predicted
# TYPE splitserve_router_cached_predicted_tokens_total counter
splitserve_router_cached_predicted_tokens_total{role="prefill",url="http://127.0.0.1:8101"} 512.0
splitserve_router_cached_predicted_tokens_total{role="decode",url="http://127.0.0.1:8201"} 256.0
# HELP splitserve_router_cached_reported_tokens_total Prompt tokens the engine reported
# TYPE splitserve_router_cached_reported_tokens_total counter
splitserve_router_cached_reported_tokens_total{role="prefill",url="http://127.0.0.1:8101"} 500.0
# HELP splitserve_router_cached_predicted_reported_tokens_total The router's prediction
# TYPE splitserve_router_cached_predicted_reported_tokens_total counter
splitserve_router_cached_predicted_reported_tokens_total{role="prefill",url="http://127.0.0.1:8101"} 512.0
# HELP splitserve_router_local_prefills_total Requests run whole on the D
# TYPE splitserve_router_local_prefills_total counter
splitserve_router_local_prefills_total{url="http://127.0.0.1:8201"} 2.0
"""  # noqa: E501


def test_parses_the_router_page() -> None:
    got = parse_router_counters(ROUTER_PAGE)
    assert got == RouterCounters(
        kv_bytes=3.5e6, kv_transfers=3.0, local_prefills=2.0,
        cached={P1: {"role": "prefill", "predicted": 512.0, "reported": 500.0,
                     "predicted_reported": 512.0},
                D1: {"role": "decode", "predicted": 256.0}})


def test_not_a_router_is_none() -> None:
    vllm = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
            'source="local_compute"} 120.0\n')
    assert parse_router_counters(vllm) is None
    assert parse_router_counters("this is { not prometheus") is None


def test_deltas_from_the_routers_own_registry() -> None:
    """Counters the router itself rendered at the run's start and stop: a worker first seen
    mid-run counts from zero; errors per worker and summed."""
    m = RouterMetrics()
    m.kv_bytes.observe(1000)
    m.cached_predicted.labels("prefill", P1).inc(128)
    m.cached_reported.labels("prefill", P1).inc(128)
    m.cached_predicted_reported.labels("prefill", P1).inc(128)
    before = parse_router_counters(generate_latest(m.registry).decode())
    m.kv_bytes.observe(4000)
    m.kv_bytes.observe(2000)
    for url, pred, told in ((P1, 256, 250), (P2, 128, 128)):
        m.cached_predicted.labels("prefill", url).inc(pred)
        m.cached_reported.labels("prefill", url).inc(told)
        m.cached_predicted_reported.labels("prefill", url).inc(pred)
    m.cached_predicted.labels("decode", D1).inc(384)
    m.local_prefills.labels(D1).inc()
    m.kv_event_lag.observe(0.010)
    m.kv_event_lag.observe(0.030)
    after = parse_router_counters(generate_latest(m.registry).decode())
    d = router_deltas(before, after)
    assert d["index_lag_s"] == pytest.approx(0.020)  # the index's mean lag over the run
    assert (d["kv_bytes_moved"], d["kv_transfers"], d["local_prefills"]) == (6000, 2, 1)
    assert d["cache_prediction"][P1] == {"role": "prefill", "predicted": 256.0,
                                         "reported": 250.0, "predicted_reported": 256.0,
                                         "error": pytest.approx(6 / 250)}
    assert d["cache_prediction"][P2]["error"] == 0.0
    # D's predictions under prefill on D: no engine report, no error
    assert d["cache_prediction"][D1]["predicted"] == 384.0
    assert d["cache_prediction"][D1]["error"] is None
    assert (d["predicted_cached_tokens"], d["reported_cached_tokens"]) == (384, 378)
    assert d["prediction_error"] == pytest.approx(6 / 378)


def test_deltas_edge_cases() -> None:
    assert router_deltas(None, RouterCounters()) == dict.fromkeys(ROUTER_KEYS)
    assert router_deltas(RouterCounters(), None) == dict.fromkeys(ROUTER_KEYS)
    empty = router_deltas(RouterCounters(), RouterCounters())
    assert empty["kv_bytes_moved"] == 0 and empty["prediction_error"] is None
    assert empty["index_lag_s"] is None  # no cache change applied
    # a router restarted mid-run: its counters restart at zero
    restarted = router_deltas(RouterCounters(kv_bytes=9000.0, kv_transfers=3.0),
                              RouterCounters(kv_bytes=500.0, kv_transfers=1.0))
    assert (restarted["kv_bytes_moved"], restarted["kv_transfers"]) == (500, 1)
    # predicted cached tokens the engine did not have
    wrong = router_deltas(RouterCounters(), RouterCounters(cached={P1: {
        "role": "prefill", "predicted": 64.0, "reported": 0.0, "predicted_reported": 64.0}}))
    assert wrong["prediction_error"] is None and wrong["predicted_cached_tokens"] == 64


def test_role_totals() -> None:
    sources = {f"prefill:{P1}": {"computed": 300.0, "cache_hit": 100.0, "loaded": 0.0},
               f"prefill:{P2}": {"computed": 100.0, "cache_hit": 0.0, "loaded": 0.0},
               f"decode:{D1}": {"computed": 4.0, "cache_hit": 96.0, "loaded": 300.0}}
    got = role_totals(sources)
    assert got["prompt_tokens_by_role"] == {
        "prefill": {"computed": 400.0, "cache_hit": 100.0, "loaded": 0.0, "hit_rate": 0.2},
        "decode": {"computed": 4.0, "cache_hit": 96.0, "loaded": 300.0, "hit_rate": 0.24}}
    assert (got["prompt_tokens_computed"], got["prompt_tokens_cache_hit"],
            got["prompt_tokens_loaded"]) == (404, 196, 300)
    assert got["worker_hit_rate"] == pytest.approx(196 / 900)
    assert role_totals({}) == {"prompt_tokens_by_role": {}, "prompt_tokens_computed": None,
                               "prompt_tokens_cache_hit": None, "prompt_tokens_loaded": None,
                               "worker_hit_rate": None}
    rows = {row[0]: row[1] for row in table_rows({"a": got | router_deltas(
        parse_router_counters(""), None)})}
    assert rows["prompt tokens computed (all workers' counters)"] == "404"
    assert rows["prompt tokens computed / cache-hit / loaded, hit rate (per role)"] == (
        "prefill 400 / 100 / 0, 0.200 ; decode 4 / 96 / 300, 0.240")
    assert "KV bytes moved (router)" not in rows  # null: no row


def test_reads_the_router_over_http() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        return httpx.Response(200, text=ROUTER_PAGE)

    transport = httpx.MockTransport(handler)
    real = httpx.AsyncClient

    def client(**kw: object) -> httpx.AsyncClient:
        return real(transport=transport, **kw)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx, "AsyncClient", client)
        got = asyncio.run(read_router_counters("http://router:1/"))
    assert got is not None and got.kv_bytes == 3.5e6
    assert asyncio.run(read_router_counters("http://127.0.0.1:1")) is None  # nothing there
