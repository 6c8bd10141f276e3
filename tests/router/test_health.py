"""The registry's health loop against scripted workers: circuit breaking, KV endpoints, load."""

from __future__ import annotations

import asyncio

from aiohttp import web

from splitserve.router.config import RouterConfig
from splitserve.router.health import Registry, kv_endpoint
from splitserve.router.http import new_session
from tests.support.scripted import workers

P = "http://p:1"
METRICS = ('vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
           'vllm:num_requests_running{engine="0"} 2.0\n')
INFO = {"role": "decode", "transport": "shm", "kv_host": "127.0.0.1", "kv_port": 7001,
        "engine_id": "e1"}


async def test_circuit_breaker_endpoints_and_load() -> None:
    up = {"p": True, "d": True}
    asked: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        asked.append(f"{name}{req.path}")
        if not up[name]:
            assert req.transport is not None
            req.transport.close()  # the connection dies: a connection-level failure
            return web.Response()
        if req.path == "/health":
            return web.Response()
        if req.path == "/metrics":
            return web.Response(text=METRICS)
        if req.path == "/splitserve/load":  # P plays a plain vLLM worker: no such route
            return (web.json_response({"kv_usage": 0.25, "running": 3.0, "waiting": 1.0})
                    if name == "d" else web.Response(status=404))
        if req.headers.get("authorization") != "Bearer tok":
            return web.Response(status=401)
        if req.path == "/splitserve/info":
            return web.json_response(INFO) if name == "d" else web.Response(status=404)
        return web.json_response({"staged_bytes": 10, "staging_capacity_bytes": 100})

    async with workers(handler, ("p", "d")) as urls:
        cfg = RouterConfig(prefill=(urls["p"],), decode=(urls["d"],), unhealthy_after=3,
                           healthy_after=2)
        session = new_session(cfg, None)  # the registry authenticates each request itself
        try:
            reg = Registry(cfg, session, "tok")
            await reg.check_all()
            (p,), (d,) = reg.by_role("prefill"), reg.by_role("decode")
            assert p.healthy and d.healthy  # a worker that answers at start is in at once
            assert d.kv_endpoint() == {"remote_host": "127.0.0.1", "remote_port": 7001,
                                       "remote_engine_id": "e1", "transport": "shm"}
            assert d.kv_endpoint("tcp")["transport"] == "tcp"
            assert p.info == {} and p.kv_endpoint() is None  # plain vLLM: no KV endpoint
            assert (d.kv_usage, d.running, d.waiting, d.staged_bytes,
                    d.staging_capacity_bytes) == (0.25, 3.0, 1.0, 10.0, 100.0)
            assert (p.kv_usage, p.running) == (0.5, 2.0)  # parsed out of a plain /metrics
            await reg.check_all()
            assert asked.count("d/splitserve/info") == 1  # the endpoint is read once
            # a splitserve worker's load never costs it a /metrics render; a plain worker is
            # asked for /splitserve/load once, then /metrics
            assert "d/metrics" not in asked
            assert asked.count("p/splitserve/load") == 1 and asked.count("p/metrics") == 2

            up["d"] = False
            for _ in range(2):
                await reg.check_all()
            assert d.healthy  # two failures: still in
            await reg.check_all()
            assert not d.healthy and reg.routable("decode") == []
            up["d"] = True
            await reg.check_all()
            assert not d.healthy  # one good check after failures is not enough
            await reg.check_all()
            assert d.healthy and d.describe()["healthy"]
        finally:
            await session.close()


async def test_remove_waits_for_open_legs() -> None:
    cfg = RouterConfig(colocated=(P,))
    session = new_session(cfg, None)
    try:
        reg = Registry(cfg, session, None)
        (w,) = reg.find(P)
        w.acquire()
        removal = asyncio.ensure_future(reg.remove(w))
        await asyncio.sleep(0.01)
        assert not removal.done() and w.draining and not w.routable
        w.release()
        assert await removal is w and reg.find(P) == []
    finally:
        await session.close()


async def test_a_workers_node_is_shown_and_labels_its_metrics() -> None:
    from prometheus_client import generate_latest

    from splitserve.router.metrics import RouterMetrics

    cfg = RouterConfig(prefill=(P,), decode=("http://d:1",))
    session = new_session(cfg, None)
    try:
        reg = Registry(cfg, session, None)
        added = reg.add("http://d2:1", "decode", node="node-b")
        added.healthy = True
        assert added.describe()["node"] == "node-b"
        assert reg.find(P)[0].describe()["node"] is None
        metrics = RouterMetrics()
        metrics.watch_workers(lambda: reg.workers.values())
        text = generate_latest(metrics.registry).decode()
    finally:
        await session.close()
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


async def test_a_nixl_decode_worker_is_not_asked_for_splitserve_staging() -> None:
    """Staging is splitserve's connector's: a D that advertises NIXL is read for its info and
    load, never for `/splitserve/state`."""
    asked: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        asked.append(req.path)
        if req.path == "/splitserve/load":
            return web.json_response({"kv_usage": 0.0, "running": 0.0, "waiting": 0.0})
        if req.path == "/splitserve/info":
            return web.json_response(INFO | {"connector": "nixl", "transport": "nixl"})
        if req.path == "/splitserve/state":
            return web.json_response({"staged_bytes": 10, "staging_capacity_bytes": 100})
        return web.Response()

    async with workers(handler, ("d",)) as urls:
        cfg = RouterConfig(prefill=(P,), decode=(urls["d"],))
        session = new_session(cfg, None)
        try:
            reg = Registry(cfg, session, "tok")
            for _ in range(2):
                await reg.check(reg.by_role("decode")[0])
            (d,) = reg.by_role("decode")
            assert d.healthy and d.info is not None and d.info["connector"] == "nixl"
            assert asked.count("/splitserve/info") == 1 and "/splitserve/state" not in asked
            assert d.staged_bytes == 0.0
        finally:
            await session.close()
