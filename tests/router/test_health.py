"""The health loop and the registry against scripted workers: circuit breaking, identity, load,
KV endpoints, and the events the registry announces (one test per kind)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from splitserve.common.vocab import Connector, Role
from splitserve.common.wire import ConnectorState, WorkerInfo
from splitserve.router.config import RouterConfig
from splitserve.router.health import HealthLoop
from splitserve.router.http import new_session
from splitserve.router.legs import leg_protocols
from splitserve.router.registry import EventKind, Registry, WorkerEvent
from splitserve.router.state import open_state
from splitserve.router.worker import Worker
from tests.support.scripted import identify, workers

P = "http://p:1"
METRICS = ('vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
           'vllm:num_requests_running{engine="0"} 2.0\n')
INFO = {"role": "decode", "transport": "shm", "kv_host": "127.0.0.1", "kv_port": 7001,
        "engine_id": "e1"}
STATE = ConnectorState(WorkerInfo.from_json(INFO), staged_bytes=10,
                       staging_capacity_bytes=100).to_json()


@asynccontextmanager
async def checked(cfg: RouterConfig, token: str | None = "tok"
                  ) -> AsyncIterator[tuple[Registry, HealthLoop, list[WorkerEvent]]]:
    """A registry over `cfg`'s workers, its health loop (not running: call `check_all`), and
    every event it announces."""
    session = new_session(cfg, None)  # the health loop authenticates each request itself
    try:
        reg = Registry(cfg)
        events: list[WorkerEvent] = []
        reg.subscribe(events.append)
        yield reg, HealthLoop(cfg, reg, session, token, leg_protocols(session, token)), events
    finally:
        await session.close()


def kinds(events: list[WorkerEvent], worker: Worker | None = None) -> list[EventKind]:
    return [e.kind for e in events if worker is None or e.worker is worker]


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
        return web.json_response(STATE)

    async with workers(handler, ("p", "d")) as urls:
        cfg = RouterConfig(prefill=(urls["p"],), decode=(urls["d"],), unhealthy_after=3,
                           healthy_after=2)
        async with checked(cfg) as (reg, checks, events):
            await checks.check_all()
            (p,), (d,) = reg.by_pool("prefill"), reg.by_pool("decode")
            assert p.healthy and d.healthy  # a worker that answers at start is in at once
            endpoints = checks.protocols
            assert endpoints.endpoint(d) == {"remote_host": "127.0.0.1", "remote_port": 7001,
                                             "remote_engine_id": "e1", "transport": "shm"}
            assert p.identity.plain and p.info is None and endpoints.endpoint(p) is None
            assert (d.kv_usage, d.running, d.waiting, d.staged_bytes,
                    d.staging_capacity_bytes) == (0.25, 3.0, 1.0, 10.0, 100.0)
            assert (p.kv_usage, p.running) == (0.5, 2.0)  # parsed out of a plain /metrics
            await checks.check_all()
            assert asked.count("d/splitserve/info") == 1  # the identity is read once
            # a splitserve worker's load never costs it a /metrics render; a plain worker is
            # asked for /splitserve/load once, then /metrics
            assert "d/metrics" not in asked
            assert asked.count("p/splitserve/load") == 1 and asked.count("p/metrics") == 2

            up["d"] = False
            for _ in range(2):
                await checks.check_all()
            assert d.healthy  # two failures: still in
            await checks.check_all()
            assert not d.healthy and reg.routable("decode") == []
            up["d"] = True
            await checks.check_all()
            assert not d.healthy  # one good check after failures is not enough
            await checks.check_all()
            assert d.healthy and d.describe()["healthy"]
            # back after failures: its identity was read again, and was the same
            assert asked.count("d/splitserve/info") == 2
            assert kinds(events, d) == [EventKind.HEALTHY, EventKind.UNHEALTHY,
                                        EventKind.HEALTHY]


@pytest.mark.parametrize("load", [b"{}", b"{", b"[" * 200_000, b'{"running": "two"}'])
async def test_a_worker_that_comes_back_as_another_engine_is_announced_restarted(
        load: bytes) -> None:
    """Before it is back in rotation, whatever its load answer: the load is advisory and read
    first, and one out of shape (bad JSON, nested past the parser's depth, a wrong type) does
    not keep the worker's identity from being read."""
    engine = {"id": "e1", "up": True}

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if not engine["up"]:
            return web.Response(status=503)
        if req.path == "/splitserve/info":
            return web.json_response(INFO | {"engine_id": engine["id"]})
        if req.path == "/splitserve/state":
            return web.json_response(STATE)
        if req.path == "/splitserve/load":
            return web.Response(body=load, content_type="application/json")
        return web.Response()

    async with workers(handler, ("d",)) as urls:
        cfg = RouterConfig(prefill=(P,), decode=(urls["d"],), unhealthy_after=1,
                           healthy_after=1)
        async with checked(cfg) as (reg, checks, events):
            (d,) = reg.by_pool("decode")
            await checks.check(d)
            assert d.info is not None and d.info.engine_id == "e1"
            assert d.staged_bytes == 10.0  # the connector's state was read too
            engine.update(up=False, id="e2")  # the engine restarts: its checks fail meanwhile
            await checks.check(d)
            engine["up"] = True
            await checks.check(d)
            assert d.info is not None and d.info.engine_id == "e2"
            restarted = [e for e in events if e.kind == EventKind.RESTARTED]
            assert len(restarted) == 1 and restarted[0].worker is d
            assert restarted[0].previous is not None and restarted[0].previous.engine_id == "e1"
            # in order: restarted before it is back in rotation
            assert kinds(events, d) == [EventKind.HEALTHY, EventKind.UNHEALTHY,
                                        EventKind.RESTARTED, EventKind.HEALTHY]


def test_identity_changes_and_request_failures_follow_the_restart_rule() -> None:
    reg = Registry(RouterConfig(prefill=(P,), decode=("http://d:1",)))
    events: list[WorkerEvent] = []
    reg.subscribe(events.append)
    (d,) = reg.by_pool("decode")
    first = WorkerInfo.from_json(INFO)
    assert d.identity.stale  # never read
    reg.identified(d, first)
    assert not d.identity.stale and events == []  # the first read is no restart
    reg.failed(d, "connection reset")  # one request failure: not out of rotation, but...
    assert d.identity.stale  # ...its identity is read again at the next good check
    reg.identified(d, first)
    assert events == []  # the same worker
    reg.identified(d, WorkerInfo.from_json(INFO | {"kv_port": 7002}))
    assert kinds(events) == [EventKind.RESTARTED]  # any other field counts too
    reg.identified(d, None)  # it now answers 404: not the worker it was
    assert kinds(events) == [EventKind.RESTARTED] * 2 and d.identity.plain


async def test_added_draining_undrained_and_removed_are_announced() -> None:
    reg = Registry(RouterConfig(colocated=(P,)))
    events: list[WorkerEvent] = []
    replayed: list[WorkerEvent] = []
    reg.subscribe(events.append)
    unsubscribe = reg.subscribe(replayed.append, replay=True)
    assert [(e.kind, e.worker.url) for e in replayed] == [(EventKind.ADDED, P)]
    added = reg.add("http://c2:1", "colocated")
    reg.drain(added)
    reg.drain(added)  # already draining: no second event
    reg.drain(added, draining=False)
    unsubscribe()
    assert await reg.remove(added) is added and reg.find("http://c2:1") == []
    assert [(e.kind, e.worker) for e in events] == [
        (EventKind.ADDED, added), (EventKind.DRAINING, added), (EventKind.UNDRAINED, added),
        (EventKind.DRAINING, added), (EventKind.REMOVED, added)]
    assert len(replayed) == 4  # the replayed ADDED, then three; unsubscribed before removal


def test_a_listener_that_raises_does_not_break_the_writer() -> None:
    reg = Registry(RouterConfig(colocated=(P,)))
    seen: list[EventKind] = []

    def bad(event: WorkerEvent) -> None:
        raise RuntimeError("listener bug")

    reg.subscribe(bad)
    reg.subscribe(lambda e: seen.append(e.kind))
    reg.add("http://c2:1", "colocated")
    assert seen == [EventKind.ADDED]


async def test_remove_waits_for_open_legs() -> None:
    reg = Registry(RouterConfig(colocated=(P,)))
    (w,) = reg.find(P)
    w.acquire()
    removal = asyncio.ensure_future(reg.remove(w))
    await asyncio.sleep(0.01)
    assert not removal.done() and w.draining and not w.routable
    w.release()
    assert await removal is w and reg.find(P) == []


def test_add_checks_the_role_and_url() -> None:
    reg = Registry(RouterConfig(colocated=(P,)))
    for url, role in ((P, "colocated"), ("http://x:1", "both"), ("x:1", "decode")):
        with pytest.raises(ValueError):
            reg.add(url, role)


async def test_a_workers_node_is_shown_and_labels_its_metrics() -> None:
    from prometheus_client import generate_latest

    from splitserve.router.metrics import RouterMetrics

    reg = Registry(RouterConfig(prefill=(P,), decode=("http://d:1",)))
    added = reg.add("http://d2:1", "decode", node="node-b")
    added.health.healthy = True
    assert added.describe()["node"] == "node-b"
    assert reg.find(P)[0].describe()["node"] is None
    metrics = RouterMetrics()
    metrics.watch_workers(reg.all)
    text = generate_latest(metrics.registry).decode()
    assert ('splitserve_router_worker_routable{node="node-b",role="decode",url="http://d2:1"} 1.0'
            in text)
    assert 'splitserve_router_worker_inflight{node="",role="prefill",url="http://p:1"} 0.0' in text


def test_describe_keeps_the_workers_keys() -> None:
    worker = Worker(P, "prefill")
    assert set(worker.describe()) == {
        "url", "role", "node", "healthy", "draining", "inflight", "inflight_prefill_tokens",
        "peer_inflight", "peer_inflight_prefill_tokens", "kv_usage", "running", "waiting",
        "staged_bytes", "staging_capacity_bytes",
        "kv_endpoint", "last_error", "checked_age_s"}


def test_kv_endpoint_is_the_advertised_one_whatever_the_connector() -> None:
    """The connector that drives a pair is `LegProtocols.for_pair`'s choice (tests/router/
    test_legs_nixl.py: a mixed pair moves no KV); the endpoint only says where a worker listens."""
    protocols = leg_protocols(None, None)  # type: ignore[arg-type]  # no HTTP here
    info: dict[str, Any] = {"kv_host": "127.0.0.1", "kv_port": 9100, "engine_id": "e"}
    for extra in ({}, {"connector": "splitserve"}, {"connector": "nixl", "transport": "nixl"}):
        d = Worker("http://d:1", "decode")
        identify(d, info | extra)
        endpoint = protocols.endpoint(d)
        assert endpoint is not None and endpoint["remote_port"] == 9100
        assert endpoint.get("transport") == extra.get("transport")
    d = Worker("http://d:1", "decode")
    identify(d, info | {"kv_port": None})
    assert protocols.endpoint(d) is None
    assert d.info is not None and (d.info.connector, d.info.role) == (Connector.SPLITSERVE,
                                                                      Role.DECODE)


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
            return web.json_response(STATE)
        return web.Response()

    async with workers(handler, ("d",)) as urls:
        async with checked(RouterConfig(prefill=(P,), decode=(urls["d"],))) as (reg, checks, _):
            for _ in range(2):
                await checks.check(reg.by_pool("decode")[0])
            (d,) = reg.by_pool("decode")
            assert d.healthy and d.info is not None and d.info.connector == Connector.NIXL
            assert asked.count("/splitserve/info") == 1 and "/splitserve/state" not in asked
            assert d.staged_bytes == 0.0


@pytest.mark.parametrize("bad", [b'{"data": [7]}', b"[" * 200_000])
async def test_the_model_is_the_first_well_formed_answer_and_a_failed_start_closes_all(
        tmp_path: Path, bad: bytes) -> None:
    """A worker whose /v1/models is out of shape is passed over for the next one; when
    starting fails after that (here: no tokenizer at the model's path), the router's cache
    followers and HTTP session are closed, and no task of it is left running."""
    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.path == "/v1/models":
            if name == "p1":
                return web.Response(body=bad, content_type="application/json")
            return web.json_response({"data": [{"id": "m", "root": str(tmp_path / "none")}]})
        return web.Response(status=404)

    async with workers(handler, ("p1", "d1")) as urls:
        cfg = RouterConfig(prefill=(urls["p1"],), decode=(urls["d1"],))
        async with checked(cfg) as (_, loop, _):
            assert (await loop.model())["id"] == "m"
        before = asyncio.all_tasks()
        with pytest.raises(Exception) as failed:
            await open_state(cfg, "tok", None, startup_timeout_s=5.0)
        assert not isinstance(failed.value, RuntimeError | AssertionError)  # the tokenizer's
        left = {t for t in asyncio.all_tasks() - before if not t.done()}
        for _ in range(100):
            if not left:
                break
            await asyncio.sleep(0.01)  # a cancelled task ends at its next step
            left = {t for t in left if not t.done()}
        assert left == set()
