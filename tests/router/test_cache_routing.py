"""Routing by cost: the `cache` policy's choices (pure), and the router's use of the cache view
(`Flow.plan`: prefill on D and its threshold; P's leg: D's cached prefix told to the leg
protocol, P's queue counting only what P computes, predicted against reported cached tokens;
prefill on D as a D leg from the prompt, resumed on another D when its D breaks)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from splitserve.common.vocab import Connector, Pool
from splitserve.common.wire import WorkerLoad
from splitserve.router.cacheview import CacheView
from splitserve.router.config import RouterConfig
from splitserve.router.flow import Flow, Plan
from splitserve.router.formats import Joiner
from splitserve.router.http import new_session
from splitserve.router.legs import LegProtocol, LegProtocols, Transfer
from splitserve.router.metrics import RouterMetrics
from splitserve.router.params import plan_legs
from splitserve.router.policy import Picker
from splitserve.router.registry import Registry
from splitserve.router.timings import Timings
from splitserve.router.worker import Staging, Worker
from splitserve.routing import CacheWeights, RouteRequest, make_policy
from tests.support.scripted import FAST_FOLLOW as FAST
from tests.support.scripted import (
    PREFILL_OK,
    ScriptedCache,
    chunk,
    identify,
    make_flow,
    sse_reply,
    until,
    workers,
)

PROMPT = list(range(1000, 1030))  # 7 blocks of 4 tokens and 2 more


def w(name: str, role: str = "prefill", kv_usage: float = 0.0) -> Worker:
    worker = Worker(f"http://{name}:1", role)
    worker.health.healthy = True
    worker.load.engine = WorkerLoad(kv_usage=kv_usage)
    return worker


def req(n: int, **cached: int) -> RouteRequest:
    return RouteRequest(n, None, 0, {f"http://{k}:1": v for k, v in cached.items()})


def test_cache_sends_p_where_the_fewest_tokens_remain_to_compute() -> None:
    a, b = w("a"), w("b")
    pick = Picker("cache", "cache")
    a.acquire(300)
    # a: 300 queued + 1000 - 900 cached = 400; b: 1000: a wins despite its queue
    assert pick.prefill([a, b], req(1000, a=900)) is a
    a.acquire(700)  # a: 1000 + 100 = 1100 > b's 1000
    assert pick.prefill([a, b], req(1000, a=900)) is b
    # the engine's waiting requests count as this prompt each, as `load` counts them
    a.release(1000)
    a.load.engine = WorkerLoad(waiting=1)
    assert pick.prefill([a, b], req(1000, a=900)) is b  # 1000 + 100 > 1000
    # weights: a cached token counts double
    heavy = Picker("cache", "cache", weights=CacheWeights(prefill_hit=2.0))
    assert heavy.prefill([a, b], req(1000, a=900)) is a  # 1000 + 1000 - 1800 < 1000


def test_cache_sends_a_follow_up_to_the_d_that_holds_the_conversation() -> None:
    holds, idle = w("holds", "decode", kv_usage=0.5), w("idle", "decode", kv_usage=0.1)
    pick = Picker("cache", "cache")
    assert pick.decode([holds, idle], req(1000)) is idle  # nothing cached: by load
    assert pick.decode([holds, idle], req(1000, holds=960)) is holds  # 1.5 - .96 < .1
    for _ in range(12):  # 12 open legs: 0.5 + 0.75 - 0.96 = 0.29 > 0.1
        holds.acquire()
    assert pick.decode([holds, idle], req(1000, holds=960)) is idle
    light = Picker("cache", "cache", weights=CacheWeights(decode_hit=0.2))
    for _ in range(12):
        holds.release()
    assert light.decode([holds, idle], req(1000, holds=960)) is idle  # 0.5 - 0.19 > 0.1
    # staging still filters first: a D that cannot hold the KV is skipped while another can
    holds.load.staging = Staging(90, 100)
    assert pick.decode([holds, idle], RouteRequest(1000, None, 50, {holds.url: 960})) is idle


def test_cache_on_colocated_workers() -> None:
    a, b, c = w("a", "colocated"), w("b", "colocated"), w("c", "colocated")
    pick = make_policy(Pool.COLOCATED, "cache")
    a.acquire()
    assert pick.pick([a, b, c], req(100, a=100)) is a  # 1 - 1 < 0
    assert pick.pick([a, b, c], req(100, a=50)) in (b, c)
    assert [pick.pick([a, b, c], req(100)).url for _ in range(2)] == [b.url, c.url]


@dataclass
class View:
    """A worker view of random signals."""

    worker_id: str
    inflight: int
    inflight_prefill_tokens: int
    waiting: float
    running: float
    kv_usage: float
    staged_bytes: float
    staging_capacity_bytes: float


def test_cache_with_nothing_cached_picks_exactly_as_load() -> None:
    """Unknown (absent), zero or no map at all: every pick is `load`'s, in every pool (the
    simulator's `cache`, whose requests are never cached, relies on this)."""
    rng = random.Random(5)
    for pool in Pool:
        cache, load = make_policy(pool, "cache"), make_policy(pool, "load")
        for _ in range(300):
            views = [View(str(i), rng.randrange(3), rng.choice([0, 100, 500]),
                          rng.randrange(2), 0.0, rng.choice([0.0, 0.5]), 0.0, 0.0)
                     for i in range(rng.randrange(1, 5))]
            n = rng.randrange(1, 2000)
            cached = rng.choice([None, {}, {"0": 0}])
            got = cache.pick(views, RouteRequest(n, None, 0, cached))
            assert got is load.pick(views, RouteRequest(n))


# --- the router's use of the view -------------------------------------------------------------
class Recording(LegProtocol):
    """A leg protocol that records what `open` was told."""

    connector = Connector.SPLITSERVE

    def __init__(self) -> None:
        self.opened: list[tuple[str, str, int]] = []

    def open(self, p: Worker, d: Worker, transfer_id: str, d_cached: int = 0
             ) -> Transfer | None:
        self.opened.append((p.url, d.url, d_cached))
        return Transfer(self, transfer_id, p, d, {"do_remote_decode": True})

    def received(self, transfer: Transfer, answer: dict[str, Any]) -> None:
        transfer.decode_params = {"transfer_id": transfer.transfer_id}

    def release(self, transfer: Transfer) -> None:
        transfer.released = True


@dataclass
class Routed:
    caches: dict[str, ScriptedCache]
    urls: dict[str, str]
    registry: Registry
    metrics: RouterMetrics
    view: CacheView
    flow: Flow
    legs: Recording
    p_seen: list[dict[str, Any]]

    def with_threshold(self, n: int) -> Flow:
        cfg = dataclasses.replace(self.flow.cfg, local_prefill_max_tokens=n)
        return Flow(cfg, self.registry, Picker(), self.metrics, self.flow.session, "m", 0,
                    2048, self.flow.protocols, self.view)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def routed(names: tuple[str, ...] = ("p0", "p1", "d0", "d1"), cached_tokens: int = 8
                 ) -> AsyncIterator[Routed]:
    """Scripted P and D workers reporting their caches (4-token blocks), a cache view over
    them and a Flow using it; P answers t1 with `cached_tokens` in its usage."""
    caches = {n: ScriptedCache() for n in names}
    p_seen: list[dict[str, Any]] = []

    async def handler(name: str, request: web.Request) -> web.StreamResponse:
        answer = await caches[name].handle(request)
        if answer is not None:
            return answer
        if request.path == "/v1/completions" and name.startswith("p"):
            body = json.loads(await request.read())
            p_seen.append(body)
            return web.json_response(PREFILL_OK | {"usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}})
        return web.Response(status=404)

    async with workers(handler, names) as urls:
        cfg = RouterConfig(prefill=tuple(u for n, u in urls.items() if n[0] == "p"),
                           decode=tuple(u for n, u in urls.items() if n[0] == "d"))
        session = new_session(cfg, None)
        reg = Registry(cfg)
        for worker in reg.all():
            worker.health.healthy = True
            identify(worker, {"kv_host": "127.0.0.1", "kv_port": 5, "engine_id": worker.url,
                              "kv_events": True, "block_size": 4})
        metrics = RouterMetrics()
        view = CacheView(reg, session, metrics, FAST)
        legs = Recording()
        flow = Flow(cfg, reg, Picker(), metrics, session, "m", 0, 2048, LegProtocols(legs),
                    view)
        try:
            await until(lambda: all(view.synced(u) for u in urls.values()))
            yield Routed(caches, urls, reg, metrics, view, flow, legs, p_seen)
        finally:
            await view.close()
            await session.close()


def legs_of(prompt: list[int], max_tokens: int = 5) -> Any:
    return plan_legs({"model": "m", "prompt": prompt, "max_tokens": max_tokens},
                     "completion", prompt)


async def test_prefill_on_d_when_d_lacks_at_most_n_tokens() -> None:
    async with routed() as r:
        d1 = r.urls["d1"]
        r.caches["d1"].store(PROMPT[:24])  # d1 holds 24 of the 30 prompt tokens
        await until(lambda: r.view.predict(PROMPT, [d1]) == {d1: 24})
        plan = r.with_threshold(6).plan(legs_of(PROMPT))
        assert plan.decode.url == d1 and plan.local and plan.local_reused == 24
        assert plan.d_cached == 24
        assert not r.with_threshold(5).plan(legs_of(PROMPT)).local  # 6 tokens left > 5
        assert not r.with_threshold(6).plan(legs_of(PROMPT, max_tokens=1)).local  # no KV moves
        off = r.with_threshold(0).plan(legs_of(PROMPT))
        assert off.decode.url == d1 and not off.local  # still chosen for its cache
        # nothing cached: never local, however short the prompt
        assert not r.with_threshold(128).plan(legs_of(list(range(5000, 5003)))).local
        # a whole prompt held: vLLM still computes its last token, so one block less is reused
        r.caches["d1"].store(PROMPT[:28])
        await until(lambda: r.view.predict(PROMPT[:28], [d1]) == {d1: 28})
        whole_held = r.with_threshold(4).plan(legs_of(PROMPT[:28]))
        assert whole_held.local and whole_held.local_reused == 24 and whole_held.d_cached == 28
        r.flow.count_local(whole_held)
        assert r.sample("splitserve_router_local_prefills_total", url=d1) == 1
        assert r.sample("splitserve_router_local_prefill_tokens_total", url=d1) == 4
        assert r.sample("splitserve_router_cached_predicted_tokens_total", role="decode",
                        url=d1) == 24
        # a D whose view is lost is not known to hold anything: split, by load
        r.caches["d1"].down = True
        await until(lambda: not r.view.synced(d1))
        assert not r.with_threshold(6).plan(legs_of(PROMPT)).local


@pytest.mark.parametrize("field", [{"truncate_prompt_tokens": 20},
                                   {"truncation_side": "left"}, {"cache_salt": "tenant-a"}])
async def test_ids_the_index_cannot_key_are_never_predicted_nor_run_on_d(
        field: dict[str, Any]) -> None:
    """Ids the engine truncates are not the ids P computes on, and a salt puts the prompt in
    blocks keyed apart from the index's: such a request is routed by its length and load
    alone, never run whole on D, whatever D holds of its unsalted, untruncated ids."""
    async with routed() as r:
        d1 = r.urls["d1"]
        r.caches["d1"].store(PROMPT[:28])
        await until(lambda: r.view.predict(PROMPT, [d1]) == {d1: 28})
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 5} | field
        plan = r.with_threshold(128).plan(plan_legs(body, "completion", PROMPT))
        assert not plan.local and plan.d_cached == 0
        assert plan.request.token_ids is None and plan.request.cached is None
        keep = field.get("truncate_prompt_tokens", len(PROMPT))
        assert plan.request.prompt_len == keep  # what P computes on: the last `keep` ids
        assert r.with_threshold(128).plan(legs_of(PROMPT)).local  # the same ids, plain


async def test_an_id_outside_int64_is_routed_by_length_for_the_worker_to_refuse() -> None:
    """vLLM answers such a prompt with a 400 (out of vocabulary); the index, which keys ids as
    int64, leaves it alone rather than fail the request with a 500."""
    async with routed() as r:
        d1 = r.urls["d1"]
        r.caches["d1"].store(PROMPT[:28])
        await until(lambda: r.view.predict(PROMPT, [d1]) == {d1: 28})
        for bad in (2**63, -(2**63) - 1):
            plan = r.with_threshold(128).plan(legs_of(PROMPT[:27] + [bad]))
            assert not plan.local and plan.request.token_ids is None
            assert plan.request.prompt_len == 28


async def test_p_leg_goes_to_the_p_that_holds_the_prefix_and_tells_the_legs_ds() -> None:
    async with routed() as r:
        p1, d0 = r.urls["p1"], r.urls["d0"]
        r.caches["p1"].store(PROMPT[:12])
        r.caches["d0"].store(PROMPT[:8])
        await until(lambda: r.view.predict(PROMPT, [p1, d0]) == {p1: 12, d0: 8})
        t = Timings()
        pre = await r.flow.prefill(legs_of(PROMPT), "rid", t)
        assert r.legs.opened == [(p1, d0, 8)]
        assert r.p_seen[-1]["prompt"] == PROMPT
        assert pre.decode is not None and pre.decode.url == d0
        assert t.as_dict()["p_cached"] == 12 and t.as_dict()["d_cached"] == 8
        r.flow.release(pre)
        assert r.sample("splitserve_router_cached_predicted_tokens_total", role="prefill",
                        url=p1) == 12
        assert r.sample("splitserve_router_cached_reported_tokens_total", role="prefill",
                        url=p1) == 8
        assert r.sample("splitserve_router_cached_predicted_reported_tokens_total",
                        role="prefill", url=p1) == 12
        assert all(w.inflight == 0 and w.inflight_prefill_tokens == 0
                   for w in r.registry.all())


async def test_p_queue_counts_only_the_tokens_p_still_computes() -> None:
    async with routed(("p0", "p1", "d0")) as r:
        p0, p1 = r.urls["p0"], r.urls["p1"]
        r.caches["p0"].store(PROMPT)  # 28 held, 28 reusable of 30 (the last token is computed)
        await until(lambda: r.view.predict(PROMPT, [p0]) == {p0: 28})
        seen: dict[str, int] = {}
        real_acquire = Worker.acquire

        def acquire(self: Worker, prompt_tokens: int = 0) -> None:
            if self.pool == Pool.PREFILL:
                seen[self.url] = prompt_tokens
            real_acquire(self, prompt_tokens)

        Worker.acquire = acquire  # type: ignore[method-assign]
        try:
            pre = await r.flow.prefill(legs_of(PROMPT), "rid", Timings())
        finally:
            Worker.acquire = real_acquire  # type: ignore[method-assign]
        r.flow.release(pre)
        assert seen == {p0: 2} and p1 not in seen


async def test_unsynced_picks_are_counted() -> None:
    async with routed(("p0", "d0")) as r:
        r.caches["p0"].down = True
        await until(lambda: not r.view.synced(r.urls["p0"]))
        pre = await r.flow.prefill(legs_of(PROMPT), "rid", Timings())
        r.flow.release(pre)
        assert r.sample("splitserve_router_kv_unsynced_picks_total", pool="prefill") == 1
        assert r.sample("splitserve_router_kv_unsynced_picks_total", pool="decode") == 0


async def test_prefill_on_d_is_a_d_leg_from_the_prompt_and_resumes_on_another_d() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "d1":  # the D that held the prompt breaks after two tokens
            return await sse_reply(req, [chunk("a", 10), chunk("b", 11)], cut=True)
        return await sse_reply(req, [chunk("c", 12), chunk("d", 13, "length")])

    async with workers(handler, ("p0", "d0", "d1")) as urls, make_flow(urls) as (flow, _):
        legs = plan_legs({"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True},
                         "completion", PROMPT)
        (d1,) = flow.registry.find(urls["d1"])
        plan = Plan(RouteRequest.of_ids(PROMPT), d1, 28, local=True, local_reused=28)
        pre = flow.local(plan)
        assert (pre.prompt_ids, pre.t1_ids, pre.transfer) == (PROMPT, [], None)
        assert d1.inflight == 1  # the leg's reservation, as a P leg takes it
        joiner = Joiner(legs, "rid", "m")
        joiner.start(pre.prompt_ids, pre.fingerprint)
        t = Timings()
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    assert "".join(c["choices"][0]["text"] for c in out) == "abcd"
    assert out[0]["choices"][0]["prompt_token_ids"] is None  # return_token_ids not asked
    assert joiner.produced == [10, 11, 12, 13] and joiner.finish_reason == "length"
    (first, body), (again, resumed) = seen
    assert (first, again) == ("d1", "d0")
    assert body["prompt"] == PROMPT and body["max_tokens"] == 4  # the whole budget on D
    assert "kv_transfer_params" not in body
    assert resumed["prompt"] == PROMPT + [10, 11] and resumed["max_tokens"] == 2
    assert t.retries == 1 and all(w.inflight == 0 for w in flow.registry.all())


async def test_prefill_on_d_compares_the_prediction_with_the_engines_cached_count() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 24}}}

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        return await sse_reply(req, [chunk("a", 10), chunk("b", 11, "length"),
                                     f"data: {json.dumps(usage)}\n\n".encode()])

    async with workers(handler, ("p0", "d0")) as urls, make_flow(urls) as (flow, metrics):
        legs = plan_legs({"model": "m", "prompt": PROMPT, "max_tokens": 2, "stream": True},
                         "completion", PROMPT)
        (d0,) = flow.registry.find(urls["d0"])
        pre = flow.local(Plan(RouteRequest.of_ids(PROMPT), d0, 28, local=True,
                              local_reused=28))
        joiner = Joiner(legs, "rid", "m")
        joiner.start(pre.prompt_ids, pre.fingerprint)
        t = Timings(mode="local", cached={"d_cached": 28})
        assert [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    assert metrics.cached_reported.labels("decode", urls["d0"])._value.get() == 24
    assert metrics.cached_predicted_reported.labels("decode", urls["d0"])._value.get() == 28
