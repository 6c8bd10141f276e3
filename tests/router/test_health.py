"""The registry's health loop against scripted workers: circuit breaking, KV endpoints, load."""

from __future__ import annotations

import asyncio

import httpx

from splitserve.router.config import RouterConfig
from splitserve.router.health import Registry, kv_endpoint

P, D = "http://p:1", "http://d:1"
METRICS = ('vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
           'vllm:num_requests_running{engine="0"} 2.0\n')
INFO = {"role": "decode", "transport": "shm", "kv_host": "127.0.0.1", "kv_port": 7001,
        "engine_id": "e1"}


async def test_circuit_breaker_endpoints_and_load() -> None:
    up = {P: True, D: True}
    asked: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        base = f"http://{req.url.host}:1"
        asked.append(f"{base}{req.url.path}")
        if not up[base]:
            raise httpx.ConnectError("refused")
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if req.url.path == "/splitserve/load":  # P plays a plain vLLM worker: no such route
            return (httpx.Response(200, json={"kv_usage": 0.25, "running": 3.0, "waiting": 1.0})
                    if base == D else httpx.Response(404))
        if req.headers.get("authorization") != "Bearer tok":
            return httpx.Response(401)
        if req.url.path == "/splitserve/info":
            return httpx.Response(200, json=INFO) if base == D else httpx.Response(404)
        return httpx.Response(200, json={"staged_bytes": 10, "staging_capacity_bytes": 100})

    cfg = RouterConfig(prefill=(P,), decode=(D,), unhealthy_after=3, healthy_after=2)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        reg = Registry(cfg, client, "tok")
        await reg.check_all()
        (p,), (d,) = reg.by_role("prefill"), reg.by_role("decode")
        assert p.healthy and d.healthy  # a worker that answers at start is in at once
        assert d.kv_endpoint() == {"remote_host": "127.0.0.1", "remote_port": 7001,
                                   "remote_engine_id": "e1", "transport": "shm"}
        assert d.kv_endpoint("tcp")["transport"] == "tcp"
        assert p.info == {} and p.kv_endpoint() is None  # plain vLLM: no KV endpoint
        assert (d.kv_usage, d.running, d.waiting, d.staged_bytes, d.staging_capacity_bytes) == (
            0.25, 3.0, 1.0, 10.0, 100.0)
        assert (p.kv_usage, p.running) == (0.5, 2.0)  # parsed out of a plain worker's /metrics
        await reg.check_all()
        assert asked.count(f"{D}/splitserve/info") == 1  # the endpoint is read once
        # a splitserve worker's load never costs it a /metrics render; a plain worker is
        # asked for /splitserve/load once, then /metrics
        assert f"{D}/metrics" not in asked
        assert asked.count(f"{P}/splitserve/load") == 1 and asked.count(f"{P}/metrics") == 2

        up[D] = False
        for _ in range(2):
            await reg.check_all()
        assert d.healthy  # two failures: still in
        await reg.check_all()
        assert not d.healthy and reg.routable("decode") == []
        up[D] = True
        await reg.check_all()
        assert not d.healthy  # one good check after failures is not enough
        await reg.check_all()
        assert d.healthy and d.describe()["healthy"]


async def test_remove_waits_for_open_legs() -> None:
    cfg = RouterConfig(colocated=(P,))
    async with httpx.AsyncClient(transport=httpx.MockTransport(
            lambda r: httpx.Response(200))) as client:
        reg = Registry(cfg, client, None)
        (w,) = reg.find(P)
        w.acquire()
        removal = asyncio.ensure_future(reg.remove(w))
        await asyncio.sleep(0.01)
        assert not removal.done() and w.draining and not w.routable
        w.release()
        assert await removal is w and reg.find(P) == []


def test_a_workers_node_is_shown_and_labels_its_metrics() -> None:
    from prometheus_client import generate_latest

    from splitserve.router.metrics import RouterMetrics

    reg = Registry(RouterConfig(prefill=(P,), decode=(D,)), httpx.AsyncClient(), None)
    added = reg.add("http://d2:1", "decode", node="node-b")
    added.healthy = True
    assert added.describe()["node"] == "node-b"
    assert reg.find(P)[0].describe()["node"] is None
    metrics = RouterMetrics()
    metrics.watch_workers(lambda: reg.workers.values())
    text = generate_latest(metrics.registry).decode()
    assert ('splitserve_router_worker_routable{node="node-b",role="decode",url="http://d2:1"} 1.0'
            in text)
    assert 'splitserve_router_worker_inflight{node="",role="prefill",url="http://p:1"} 0.0' in text


def test_kv_endpoint_is_the_advertised_one_whatever_the_connector() -> None:
    """The connector that drives a pair is `LegProtocols.for_pair`'s choice (tests/router/
    test_legs_nixl.py: a mixed pair moves no KV); the endpoint only says where a worker listens."""
    info = {"role": "decode", "kv_host": "127.0.0.1", "kv_port": 9100, "engine_id": "e"}
    assert kv_endpoint(info)["remote_port"] == 9100
    assert kv_endpoint(info | {"connector": "splitserve"})["remote_port"] == 9100
    nixl = kv_endpoint(info | {"connector": "nixl", "transport": "nixl"})
    assert nixl is not None and (nixl["remote_port"], nixl["transport"]) == (9100, "nixl")
    assert kv_endpoint(info | {"kv_port": None}) is None
