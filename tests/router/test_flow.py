"""The two legs against scripted workers (small aiohttp servers on loopback): P retried on
another P with a fresh transfer id, D resumed on another D (or a colocated worker) with prompt +
every token already produced, 4xx passed through untouched, a closed leg aborted on the worker,
and the deployment token on every request. Real workers are in test_e2e.py; these pin the
failure paths down exactly."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from splitserve.common.chat import chat_template_sha256
from splitserve.common.vocab import Connector, Pool, Role
from splitserve.common.wire import WorkerInfo
from splitserve.router.config import RouterConfig
from splitserve.router.endpoints import Choice, choose_mode
from splitserve.router.failures import UpstreamError
from splitserve.router.flow import Flow
from splitserve.router.params import RequestError, plan_legs
from splitserve.router.policy import NoWorker, Overloaded
from splitserve.router.registry import Registry
from splitserve.router.state import RouterState
from splitserve.router.timings import Timings
from tests.support.scripted import (
    PREFILL_OK,
    chunk,
    closed_port,
    identify,
    make_flow,
    split_once,
    sse_reply,
    started,
    workers,
)


def speak_splitserve_tcp(flow: Flow) -> None:
    """Every worker says it runs splitserve's connector over tcp (KV endpoint 127.0.0.1:5)."""
    for w in flow.registry.workers.values():
        identify(w, {"kv_host": "127.0.0.1", "kv_port": 5, "engine_id": "e",
                     "transport": "tcp"})


async def test_prefill_retries_elsewhere_and_decode_resumes_without_loss() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if name == "p2":
            return web.json_response(PREFILL_OK)
        if name == "d1":
            return await sse_reply(req, [chunk("b", 11), chunk("c", 12)], cut=True)
        return await sse_reply(req, [chunk("d", 13), chunk("e", 14, "length")])

    async with workers(handler, ("p1", "p2", "d1", "d2")) as urls, make_flow(urls) as (
            flow, metrics):
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 5, "stream": True},
                         "completion", "x")
        t = Timings()
        pre = await flow.prefill(legs, "rid", t)
        assert [n for n, _ in seen] == ["p1", "p2"] and pre.t1_ids == [10]
        assert pre.finish_reason is None
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    assert "".join(c["choices"][0]["text"] for c in out) == "bcde"
    assert joiner.produced == [10, 11, 12, 13, 14] and joiner.finish_reason == "length"
    (_, resumed), = [(n, b) for n, b in seen if n == "d2"]
    assert resumed["prompt"] == [1, 2, 3, 10, 11, 12] and resumed["max_tokens"] == 2
    assert "kv_transfer_params" not in resumed  # recomputed on the new D: no foreign KV read
    assert t.retries == 2
    assert t.as_dict()["d_queue_s"] >= 0  # the resumed leg's own queue, not across attempts
    assert all(w.inflight == 0 for w in flow.registry.workers.values())  # nothing left open
    assert metrics.failures.labels("prefill", "http_503")._value.get() == 1
    assert metrics.failures.labels("decode", "ClientPayloadError")._value.get() == 1


async def test_decode_resumes_on_a_colocated_worker_when_no_other_d_is_routable() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response(PREFILL_OK)
        if name == "d1":
            return await sse_reply(req, [chunk("b", 11)], cut=True)
        return await sse_reply(req, [chunk("c", 12), chunk("d", 13, "length")])

    async with workers(handler, ("p1", "d1", "c1")) as urls, make_flow(urls) as (flow, _):
        out, joiner, t = await split_once(flow, 4)
    assert [n for n, _ in seen] == ["p1", "d1", "c1"]
    assert "".join(c["choices"][0]["text"] for c in out) == "bcd"
    assert seen[-1][1]["prompt"] == [1, 2, 3, 10, 11] and seen[-1][1]["max_tokens"] == 2
    assert t.decode_url == urls["c1"] and joiner.produced == [10, 11, 12, 13]


def error_event(code: int) -> bytes:
    """What vLLM writes into a stream whose request failed after it began (`EngineDeadError`
    and the like are code 500)."""
    err = {"error": {"message": "engine failed", "type": "InternalServerError", "param": None,
                     "code": code}}
    return f"data: {json.dumps(err)}\n\n".encode()


@pytest.mark.parametrize("code", [500, 400])
async def test_an_error_event_mid_stream_resumes_unless_it_is_the_answer(code: int) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response(PREFILL_OK)
        if name == "d1":
            return await sse_reply(req, [chunk("b", 11), error_event(code)])
        return await sse_reply(req, [chunk("c", 12), chunk("d", 13, "length")])

    async with workers(handler, ("p1", "d1", "d2")) as urls, make_flow(urls) as (flow, _):
        if code == 400:  # a client error is the answer: not retried
            with pytest.raises(UpstreamError) as err:
                await split_once(flow, 4)
            assert err.value.status == 400 and [n for n, _ in seen] == ["p1", "d1"]
            assert all(w.inflight == 0 for w in flow.registry.workers.values())
            return
        out, joiner, _ = await split_once(flow, 4)
    assert [n for n, _ in seen] == ["p1", "d1", "d2"]
    assert seen[-1][1]["prompt"] == [1, 2, 3, 10, 11]
    assert "".join(c["choices"][0]["text"] for c in out) == "bcd"
    assert joiner.produced == [10, 11, 12, 13]


async def test_a_leg_broken_after_its_last_token_is_not_resumed() -> None:
    """D's finish chunk came, then the connection broke (before usage or `[DONE]`): the answer
    is whole; a second leg would add tokens past its end."""
    seen: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append(name)
        if name == "p1":
            return web.json_response(PREFILL_OK)
        if name == "d1":
            return await sse_reply(req, [chunk("b", 11), chunk("c", 2, "stop")], cut=True)
        return await sse_reply(req, [chunk("x", 12), chunk("y", 13, "length")])

    async with workers(handler, ("p1", "d1", "d2")) as urls, make_flow(urls) as (flow, _):
        out, joiner, _ = await split_once(flow, 6)
    assert seen == ["p1", "d1"]
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"
    assert joiner.produced == [10, 11, 2] and joiner.finish_reason == "stop"


async def test_closing_the_decode_leg_aborts_it_on_the_worker() -> None:
    aborted = asyncio.Event()

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if name == "p1":
            return web.json_response(PREFILL_OK)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        try:
            for i in range(500):  # a long generation, one token every 10 ms
                await resp.write(chunk("x", 100 + i))
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            aborted.set()  # vLLM aborts the request when its client's connection closes
            raise
        return resp

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 600, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        gen = flow.decode(legs, "rid", pre, started(legs, pre), t)
        for _ in range(3):
            await anext(gen)
        await gen.aclose()  # what a client disconnect does to the open leg
        await asyncio.wait_for(aborted.wait(), 5)
        assert all(w.inflight == 0 for w in flow.registry.workers.values())


async def test_client_errors_are_the_answer_not_retried() -> None:
    calls: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        calls.append(name)
        return web.json_response({"error": {"message": "max_tokens too big",
                                             "type": "BadRequestError", "param": "max_tokens",
                                             "code": 400}}, status=400)

    async with workers(handler, ("p1", "p2", "d1")) as urls, make_flow(urls) as (flow, _):
        legs = plan_legs({"model": "m", "prompt": "x"}, "completion", "x")
        with pytest.raises(UpstreamError) as err:
            await flow.prefill(legs, "rid", Timings())
    assert err.value.status == 400 and err.value.body["error"]["param"] == "max_tokens"
    assert len(calls) == 1


async def test_request_ending_at_t1_needs_no_decode_and_moves_no_kv() -> None:
    bodies: list[dict[str, Any]] = []
    discarded: list[str] = []
    auth: set[str | None] = set()

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        auth.add(req.headers.get("Authorization"))
        if req.method == "DELETE":  # D told that no decode leg will claim the staged KV
            discarded.append(req.path.rsplit("/", 1)[1])
            return web.json_response({"discarded": True})
        bodies.append(await req.json())
        return web.json_response(PREFILL_OK)

    async with workers(handler, ("p1", "p2", "d1", "d2")) as urls, make_flow(
            urls, token="tok") as (flow, _):
        speak_splitserve_tcp(flow)
        one = plan_legs({"model": "m", "prompt": "x", "max_tokens": 1}, "completion", "x")
        pre = await flow.prefill(one, "rid", Timings())
        assert pre.decode is None and pre.finish_reason == "length" and not pre.reserved
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
        assert "kv_transfer_params" not in bodies[-1]
        for w in flow.registry.routable(Pool.DECODE):  # no D in rotation: it needs none
            w.draining = True
        t = Timings()
        plan = flow.plan(one)
        assert plan.decode is None and not plan.local
        pre = await flow.prefill(one, "rid", t, plan)
        assert pre.decode is None and pre.t1_ids == [10] and t.decode_url is None
        with pytest.raises(NoWorker):  # a request of more tokens does need a D
            flow.plan(plan_legs({"model": "m", "prompt": "x", "max_tokens": 2}, "completion",
                                "x"))
        for w in flow.registry.workers.values():
            w.draining = False
        more = plan_legs({"model": "m", "prompt": "x", "max_tokens": 4}, "completion", "x")
        pre = await flow.prefill(more, "rid", Timings())
        kv = bodies[-1]["kv_transfer_params"]
        assert kv["do_remote_decode"] and kv["remote_port"] == 5 and kv["transport"] == "tcp"
        assert pre.transfer is not None
        assert pre.transfer.decode_params == {"do_remote_prefill": True,
                                              "transfer_id": kv["transfer_id"]}
        # the chosen D is held from the moment it is picked, so a burst spreads over both Ds
        assert pre.reserved and pre.decode is not None and pre.decode.inflight == 1
        second = await flow.prefill(more, "rid2", Timings())
        assert second.decode is not None and second.decode is not pre.decode
        flow.release(pre)
        flow.release(second)
        flow.release(second)  # idempotent
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
        for _ in range(100):  # let the background DELETEs run
            if len(discarded) == 2:
                break
            await asyncio.sleep(0.01)
    assert pre.transfer is not None and second.transfer is not None
    assert sorted(discarded) == sorted([pre.transfer.transfer_id, second.transfer.transfer_id])
    assert auth == {"Bearer tok"}  # every request to a worker carries the deployment token


@pytest.mark.parametrize("first_d", ["busy", "refuses", "cut"])
async def test_a_failed_first_decode_leg_releases_its_transfer(first_d: str) -> None:
    """D's first leg fails: vLLM's queue is full (503, resumed on the other D), D refuses it
    (400, the client's answer), or its stream is cut (resumed). The next leg recomputes, or
    none comes, so the router tells that D at once that no leg will load the staged KV."""
    discarded: list[tuple[str, str]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.method == "DELETE":
            discarded.append((name, req.path.rsplit("/", 1)[1]))
            return web.json_response({"discarded": True})
        if name == "p1":
            return web.json_response(PREFILL_OK)
        body = await req.json()
        if "kv_transfer_params" in body and first_d == "busy":
            return web.json_response({"error": {"message": "queue full"}}, status=503)
        if "kv_transfer_params" in body and first_d == "refuses":
            return web.json_response({"error": {"message": "no"}}, status=400)
        if "kv_transfer_params" in body:
            return await sse_reply(req, [chunk("b", 11)], cut=True)
        return await sse_reply(req, [chunk("c", 12), chunk("d", 13, "length")])

    async with workers(handler, ("p1", "d1", "d2")) as urls, make_flow(
            urls, token="tok") as (flow, _):
        speak_splitserve_tcp(flow)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 4, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        assert pre.transfer is not None and pre.decode is not None
        first, tid = pre.decode.url, pre.transfer.transfer_id
        stream = flow.decode(legs, "rid", pre, started(legs, pre), t)
        if first_d == "refuses":
            with pytest.raises(UpstreamError):
                _ = [c async for c in stream]
        else:
            _ = [c async for c in stream]
        for _ in range(100):  # the DELETE runs in the background
            if discarded:
                break
            await asyncio.sleep(0.01)
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    assert [(urls[n], i) for n, i in discarded] == [(first, tid)]


@pytest.mark.parametrize("bad", [
    b"not json", b"[" * 200_000, b"[]", b'{"choices": []}', b'{"choices": [1]}',
    b'{"choices": [{"text": "a"}], "kv_transfer_params": "x"}',
    b'{"choices": [{"text": "a", "prompt_token_ids": 5}]}',
    b'{"choices": [{"text": "a", "token_ids": [7, "x"]}]}',
    b'{"choices": [{"text": "a", "token_ids": [7]}], "usage": [1]}',
    b'{"choices": [{"text": 3, "token_ids": [7]}]}'])
async def test_an_answer_out_of_shape_from_p_is_retried_and_frees_everything(bad: bytes
                                                                           ) -> None:
    """P answers 200 with a body that is not a completion: the attempt fails like a worker
    error (retried on the other P), and nothing stays reserved; with no other P the client
    gets one explicit 502."""
    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.method == "DELETE":
            return web.json_response({"discarded": True})
        if name == "p1":
            return web.Response(body=bad, content_type="application/json")
        return web.json_response(PREFILL_OK)

    legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 4}, "completion", "x")
    async with workers(handler, ("p1", "p2", "d1")) as urls, make_flow(urls) as (flow, _):
        flow.registry.workers[Pool.PREFILL, urls["p2"]].acquire()  # p1 is picked first
        pre = await flow.prefill(legs, "rid", t := Timings())
        assert pre.t1_ids == [10] and t.prefill_url == urls["p2"] and t.retries == 1
        flow.release(pre)
        flow.registry.workers[Pool.PREFILL, urls["p2"]].release()
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        with pytest.raises(UpstreamError) as err:
            await flow.prefill(legs, "rid", Timings())
        assert err.value.status == 502 and "bad_answer" in err.value.body["error"]["message"]
        assert all(w.inflight == 0 for w in flow.registry.workers.values())


async def test_every_prefill_failure_ends_in_one_explicit_error() -> None:
    urls = {"p1": f"http://127.0.0.1:{closed_port()}", "d1": f"http://127.0.0.1:{closed_port()}"}
    async with make_flow(urls) as (flow, _):
        legs = plan_legs({"model": "m", "prompt": "x"}, "completion", "x")
        with pytest.raises(UpstreamError) as err:
            await flow.prefill(legs, "rid", Timings())
    assert err.value.status == 502 and "prefill failed" in err.value.body["error"]["message"]


async def test_transfer_record_is_fetched_while_d_streams() -> None:
    gets: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if req.method == "GET":  # D's record of the transfer, asked for once
            gets.append(name)
            tid = req.path.rsplit("/", 1)[1]
            return web.json_response({"transfer_id": tid, "recv": {
                "transfer_id": tid, "side": "recv", "status": "loaded", "bytes": 5,
                "duration_s": 0.5, "tail_s": 0.002, "wire_s": 0.001, "gbps": 5e-6}})
        if name == "p1":
            return web.json_response(PREFILL_OK)
        return await sse_reply(req, [chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls, token="tok") as (flow, _):
        speak_splitserve_tcp(flow)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        assert pre.transfer is not None
        _ = [c async for c in flow.decode(legs, "rid", pre, started(legs, pre), t)]
        await flow.transfer_record(t)
    assert gets == ["d1"] and t.kv is not None and t.kv.status == "loaded"
    d = t.as_dict()
    assert (d["kv_bytes"], d["kv_transfer_s"], d["kv_tail_s"], d["kv_wire_s"], d["kv_gbps"]) == (
        5, 0.5, 0.002, 0.001, 5e-6)


async def test_backpressure_is_429_and_only_connection_failures_trip_the_breaker() -> None:
    """Workers answering 503/500 are alive: they stay in rotation, and when every P says "not
    now" the client gets 429 (Retry-After), not a 5xx. A refused connection does count."""
    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if name == "p1":
            return web.json_response({"error": {"message": "queue full"}}, status=503)
        return web.json_response({"error": {"message": "engine said no"}}, status=500)

    async with workers(handler, ("p1", "p2", "d1")) as urls:
        urls["p3"] = f"http://127.0.0.1:{closed_port()}"
        async with make_flow(urls) as (flow, _):
            cfg_unhealthy = flow.cfg.unhealthy_after
            legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 4}, "completion", "x")
            for _ in range(cfg_unhealthy):
                with pytest.raises((UpstreamError, Overloaded)):
                    await flow.prefill(legs, "rid", Timings())
            by_url = {w.url: w for w in flow.registry.workers.values()}
            assert by_url[urls["p1"]].healthy and by_url[urls["p2"]].healthy
            assert not by_url[urls["p3"]].healthy  # refused every time: out of rotation
            # only the back-pressured P left: every attempt is "not now"
            by_url[urls["p2"]].draining = True
            with pytest.raises(Overloaded):
                await flow.prefill(legs, "rid", Timings())


def test_a_request_of_one_token_needs_a_p_and_no_d() -> None:
    """With every D out of rotation, a request of one token is still split (P's alone); one
    of more tokens has no worker."""
    cfg = RouterConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",))
    reg = Registry(cfg)
    for w in reg.all():
        w.health.healthy = True
    for w in reg.routable(Pool.DECODE):
        w.draining = True
    st = cast(RouterState, SimpleNamespace(registry=reg, cfg=cfg, tokenizer=None,
                                           chat_format=lambda: None))
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert choose_mode(st, {"prompt": "x", "max_tokens": 1}, "completion").mode == "split"
    assert choose_mode(st, {**chat, "max_completion_tokens": 1}, "chat").mode == "split"
    with pytest.raises(NoWorker):
        choose_mode(st, {"prompt": "x", "max_tokens": 2}, "completion")


def test_chats_are_split_only_when_the_workers_render_from_the_routers_template() -> None:
    """The router renders a chat itself only when every P and D in rotation advertises its
    template's digest; otherwise the chat runs whole, or is refused under `refuse`."""
    own = chat_template_sha256("{{ messages }}", {})
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for unsplittable in ("whole", "refuse"):
        cfg = RouterConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",),
                           unsplittable=unsplittable)
        reg = Registry(cfg)
        st = SimpleNamespace(registry=reg, cfg=cfg, tokenizer=object(), chat_template_sha256=own)
        st.chat_format = lambda st=st: RouterState.chat_format(cast(RouterState, st))
        for w in reg.all():
            w.health.healthy = True
            reg.identified(w, WorkerInfo(Connector.SPLITSERVE, w.pool.worker_role or Role.BOTH,
                                         chat_format="string", chat_template_sha256=own))
        # what was checked is what the router renders: the messages as the template sees them
        assert choose_mode(cast(RouterState, st), chat, "chat") == Choice("split", chat["messages"])
        parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]}
        assert choose_mode(cast(RouterState, st), parts, "chat").messages == [
            {"role": "user", "content": "a\nb"}]
        p = reg.routable(Pool.PREFILL)[0]
        reg.identified(p, WorkerInfo(Connector.SPLITSERVE, Role.PREFILL, chat_format="string",
                                     chat_template_sha256=chat_template_sha256("other", {})))
        if unsplittable == "whole":
            assert choose_mode(cast(RouterState, st), chat, "chat") == Choice("whole")
            assert choose_mode(cast(RouterState, st), {"prompt": "x"}, "completion") == Choice(
                "split")
        else:
            with pytest.raises(RequestError, match="another chat template"):
                choose_mode(cast(RouterState, st), chat, "chat")
