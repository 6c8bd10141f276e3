"""The leg protocol over vLLM's MooncakeConnector (`router.legs.mooncake`) and the concurrent
dispatch it asks of `Flow` (`router.early`): P's engine id from its bootstrap server (refreshed
when P restarts), both legs sent at once with one transfer id, D's replayed t1 checked and
dropped, and D's early leg aborted when P fails (P retried under a fresh transfer id) or the
request ends at t1. Scripted workers answer as Mooncake workers and P's bootstrap server do;
real ones are in tests/mooncakeconnector."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from splitserve.common.wire import WorkerInfo
from splitserve.router.legs import DecodeStart, MooncakeLegs
from splitserve.router.legs.mooncake import bootstrap_address, engine_id_of
from splitserve.router.params import plan_legs
from splitserve.router.timings import Timings
from tests.support.scripted import (
    PREFILL_OK,
    chunk,
    identify,
    make_flow,
    sse_reply,
    started,
    workers,
)


def query_answer(engine: str) -> dict[str, Any]:
    """P's bootstrap server's `/query` (vLLM 0.32): data-parallel rank -> engine and ranks."""
    return {"0": {"engine_id": engine, "worker_addr": {"0": {"0": "tcp://127.0.0.1:7001"}}}}


def test_the_engine_id_and_bootstrap_address_are_read_as_vllm_writes_them() -> None:
    assert engine_id_of(query_answer("e-1")) == "e-1"
    for bad in ({}, [], {"0": {"worker_addr": {}}}, {"0": {"engine_id": ""}}):
        with pytest.raises(ValueError):
            engine_id_of(bad)
    info = WorkerInfo(connector="mooncake", role="prefill", kv_host="0.0.0.0", kv_port=8998)
    assert bootstrap_address("http://10.0.0.5:8000", info) == "http://10.0.0.5:8998"
    assert bootstrap_address("http://[::1]:8000", info) == "http://[::1]:8998"
    assert bootstrap_address("http://h:1", WorkerInfo(connector="mooncake", role="prefill")) is None


async def test_ps_engine_id_comes_from_its_bootstrap_server_and_is_refreshed() -> None:
    engine = ["e-1"]

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        assert req.path == "/query"
        if not engine:
            return web.json_response({"detail": "starting"}, status=503)
        return web.json_response(query_answer(engine[0]))

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        legs = flow.protocols.by_connector["mooncake"]
        assert isinstance(legs, MooncakeLegs)
        p = flow.registry.workers[("prefill", urls["p1"])]
        d = flow.registry.workers[("decode", urls["d1"])]
        port = urlsplit(urls["p1"]).port
        identify(p, {"connector": "mooncake", "kv_port": port})
        identify(d, {"connector": "mooncake", "kv_port": 1})
        assert legs.open(p, d, "rid-1") is None  # not known yet: D recomputes
        await legs.poll_prefill(p)
        tr = legs.open(p, d, "rid-2")
        assert tr is not None and tr.prefill_params == {"do_remote_decode": True,
                                                        "transfer_id": "rid-2"}
        assert tr.decode_params == {"do_remote_prefill": True, "transfer_id": "rid-2",
                                    "remote_engine_id": "e-1",
                                    "remote_bootstrap_addr": f"http://127.0.0.1:{port}"}
        assert legs.decode_start(tr, [10]) == DecodeStart(tr.decode_params, replayed=1)
        engine[0] = "e-2"  # P restarted
        await legs.poll_prefill(p)
        tr = legs.open(p, d, "rid-3")
        assert tr is not None and tr.decode_params["remote_engine_id"] == "e-2"
        engine.clear()  # P's bootstrap server is not answering now
        await legs.poll_prefill(p)
        assert legs.open(p, d, "rid-4") is None


async def test_both_legs_go_at_once_and_d_replays_t1() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    d_arrived = asyncio.Event()

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.path == "/query":
            return web.json_response(query_answer("e-p"))
        seen.append((name, await req.json()))
        if name == "p1":
            await asyncio.wait_for(d_arrived.wait(), 5)  # D's leg is out before P answers
            return web.json_response(PREFILL_OK)
        d_arrived.set()
        return await sse_reply(req, [chunk("a", 10), chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        await mooncake_workers(flow, urls)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
                         "completion", "x")
        t = Timings()
        pre = await flow.prefill(legs, "rid", t)
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"  # D's "a" is P's t1 again
    assert joiner.produced == [10, 11, 12]
    (_, p_body), (_, d_body) = seen
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert tid.startswith("rid-") and t.transfer_id == tid
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"]
    assert d_body["prompt"] == "x" and d_body["max_tokens"] == 3 and d_body["stream"]
    assert d_body["kv_transfer_params"] == {
        "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "e-p",
        "remote_bootstrap_addr": f"http://127.0.0.1:{urlsplit(urls['p1']).port}"}


async def test_a_failed_p_aborts_ds_early_leg_and_retries_under_a_fresh_id() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    aborted: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.path == "/query":
            return web.json_response(query_answer(f"e-{name}"))
        body = await req.json()
        seen.append((name, body | {"request_id": req.headers["X-Request-Id"]}))
        if name == "p1":
            await asyncio.sleep(0.2)  # D's first leg is waiting for this P's blocks
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if name == "p2":
            return web.json_response(PREFILL_OK)
        engine = body["kv_transfer_params"]["remote_engine_id"]
        if engine == "e-p1":
            return await held_until_closed(req, aborted)
        return await sse_reply(req, [chunk("a", 10), chunk("b", 11, "length")])

    async with workers(handler, ("p1", "p2", "d1")) as urls, make_flow(urls) as (flow, _):
        await mooncake_workers(flow, urls)
        flow.registry.workers[("prefill", urls["p2"])].acquire(10)  # the picker tries p1 first
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 2, "stream": True},
                         "completion", "x")
        t = Timings()
        pre = await flow.prefill(legs, "rid", t)
        flow.registry.workers[("prefill", urls["p2"])].release(10)
        await asyncio.wait_for(until_aborted(aborted), 5)
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    assert "".join(c["choices"][0]["text"] for c in out) == "b" and t.retries == 1
    tids = [b["kv_transfer_params"]["transfer_id"] for n, b in seen if n.startswith("p")]
    assert len(tids) == 2 and tids[0] != tids[1]
    d_tids = [b["kv_transfer_params"]["transfer_id"] for n, b in seen if n == "d1"]
    assert d_tids == tids and aborted == [tids[0]]
    # each leg named after the request and its P attempt
    assert sorted(b["request_id"] for _, b in seen) == ["rid-p0", "rid-p0d", "rid-p1", "rid-p1d"]


async def test_a_request_ending_at_t1_aborts_ds_early_leg() -> None:
    aborted: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.path == "/query":
            return web.json_response(query_answer("e-p"))
        await req.read()
        if name == "p1":
            await asyncio.sleep(0.1)
            stop = {**PREFILL_OK["choices"][0], "finish_reason": "stop"}
            return web.json_response(PREFILL_OK | {"choices": [stop]})
        return await held_until_closed(req, aborted)

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        await mooncake_workers(flow, urls)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 50, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", Timings())
        assert pre.finish_reason == "stop" and pre.decode is None
        await asyncio.wait_for(until_aborted(aborted), 5)
        assert all(w.inflight == 0 for w in flow.registry.workers.values())


async def mooncake_workers(flow: Any, urls: dict[str, str]) -> None:
    """Every scripted worker identified as a Mooncake worker whose bootstrap server is itself
    (the handler answers `/query`), and every P's engine id read from it."""
    legs = flow.protocols.by_connector["mooncake"]
    for w in flow.registry.workers.values():
        identify(w, {"connector": "mooncake", "kv_port": urlsplit(w.url).port})
        if w.pool == "prefill":
            await legs.poll_prefill(w)


async def held_until_closed(req: web.Request, aborted: list[str]) -> web.StreamResponse:
    """A D leg that waits for a pull that never comes: it notes its transfer id when the router
    closes the connection (vLLM then aborts the request)."""
    tid = (await req.json())["kv_transfer_params"]["transfer_id"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(req)
    try:
        for _ in range(500):
            await resp.write(b": waiting\n\n")
            await asyncio.sleep(0.01)
    except (ConnectionResetError, asyncio.CancelledError):
        aborted.append(tid)
        raise
    return resp


async def until_aborted(aborted: list[str], count: int = 1) -> None:
    while len(aborted) < count:
        await asyncio.sleep(0.01)



async def test_a_client_gone_during_ps_leg_aborts_both_legs() -> None:
    """Cancelling the request's task while P prefills (what a client disconnect does) closes
    P's leg and the D leg sent with it: vLLM aborts both."""
    aborted: list[str] = []
    p_started = asyncio.Event()

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.path == "/query":
            return web.json_response(query_answer("e-p"))
        if name == "p1":
            tid = (await req.json())["kv_transfer_params"]["transfer_id"]
            p_started.set()
            try:
                await asyncio.sleep(30)  # a long prefill
            except asyncio.CancelledError:
                aborted.append(f"p:{tid}")
                raise
            return web.json_response(PREFILL_OK)
        return await held_until_closed(req, aborted)

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        await mooncake_workers(flow, urls)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 50, "stream": True},
                         "completion", "x")
        task = asyncio.ensure_future(flow.prefill(legs, "rid", Timings()))
        await asyncio.wait_for(p_started.wait(), 5)
        await asyncio.sleep(0.1)  # D's leg is out too
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(until_aborted(aborted, 2), 5)
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    (p_tid,) = [a[2:] for a in aborted if a.startswith("p:")]
    assert sorted(aborted) == sorted([f"p:{p_tid}", p_tid])  # both legs of that attempt
