"""The one retry helper behind P's leg, D's resumption and the whole path: attempts counted in
the request's timings and metrics, the workers tried, and `--whole-retries` as the whole path's
own limit (defaulting, on the command line, to `--prefill-retries`)."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from aiohttp import web

from splitserve.router.cli import add_router_arguments, config_from_args
from splitserve.router.config import RouterConfig
from splitserve.router.failures import LegFailed, Retry
from splitserve.router.http import new_session
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import Overloaded, Picker
from splitserve.router.registry import Registry
from splitserve.router.timings import Timings
from splitserve.router.whole import Passthrough
from splitserve.router.worker import Worker
from tests.support.scripted import workers


def args_of(*argv: str) -> RouterConfig:
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    return config_from_args(p.parse_args(["--colocated", "http://c:1", *argv]))


def test_whole_retries_default_to_prefill_retries_on_the_command_line() -> None:
    assert args_of().whole_retries == 2
    assert args_of("--prefill-retries", "3").whole_retries == 3
    cfg = args_of("--prefill-retries", "3", "--whole-retries", "0")
    assert (cfg.prefill_retries, cfg.whole_retries) == (3, 0)
    with pytest.raises(ValueError):
        RouterConfig(colocated=("http://c:1",), whole_retries=-1)


async def test_retry_counts_each_retry_and_remembers_the_workers_tried() -> None:
    cfg = RouterConfig(colocated=("http://c:1",), retry_backoff_s=0.0)
    session = new_session(cfg, None)
    try:
        reg, metrics, t = Registry(cfg), RouterMetrics(), Timings()
        retry = Retry(cfg, metrics, reg, "whole", 2, t, "rid")
        w = Worker("http://c:1", "colocated")
        w.health.healthy = True
        attempts = []
        for attempt in retry:
            await retry.begin(attempt)
            attempts.append(attempt)
            retry.failed(w, LegFailed("http_503", "busy", 503))
    finally:
        await session.close()
    assert attempts == [0, 1, 2] and t.retries == 2
    assert metrics.retries.labels("whole")._value.get() == 2
    assert metrics.failures.labels("whole", "http_503")._value.get() == 3
    assert retry.tried == {"http://c:1"} and isinstance(retry.last, LegFailed)
    assert w.healthy  # an HTTP answer is the worker speaking: not a breaker failure


async def test_the_whole_path_retries_up_to_whole_retries() -> None:
    calls: list[str] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        calls.append(name)
        if name == "c1":
            return web.json_response({"error": {"message": "queue full"}}, status=503)
        return web.json_response({"ok": name})

    async with workers(handler, ("c1", "c2")) as urls:
        for limit, expected in ((1, ["c1", "c2"]), (0, ["c1"])):
            calls.clear()
            cfg = RouterConfig(colocated=(urls["c1"], urls["c2"]), retry_backoff_s=0.0,
                               prefill_retries=5, whole_retries=limit)
            session = new_session(cfg, None)
            try:
                reg = Registry(cfg)
                for w in reg.all():
                    w.health.healthy = True
                    if w.url != urls["c1"]:
                        w.acquire()  # c1 is picked first
                whole = Passthrough(cfg, reg, Picker("load", "load"), RouterMetrics(), session)
                if limit:
                    status, body, _ = await whole.complete("/v1/completions", b"{}", "rid",
                                                           t := Timings())
                    assert status == 200 and b"c2" in body and t.retries == 1
                else:
                    with pytest.raises(Overloaded):  # the only attempt said "not now"
                        await whole.complete("/v1/completions", b"{}", "rid", Timings())
            finally:
                await session.close()
            assert calls == expected


async def test_a_client_leaving_a_whole_request_gives_the_worker_back() -> None:
    """The client leaves (its task is cancelled, as `cancellable` does) while the worker is
    still computing a non-streaming answer, or while the router reads a retryable answer's
    body: the worker's in-flight count returns to zero and it counts as drained."""
    answering = asyncio.Event()  # the worker has the request (and, slow-body, sent headers)

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        if name == "slow-body":  # headers of a retryable status at once, its body later
            resp = web.StreamResponse(status=503)
            await resp.prepare(req)
            answering.set()
            await asyncio.sleep(5)
            return resp
        answering.set()
        await asyncio.sleep(5)  # no headers until the whole answer is computed
        return web.json_response({"ok": name})

    for name in ("slow-answer", "slow-body"):
        async with workers(handler, (name,)) as urls:
            cfg = RouterConfig(colocated=(urls[name],), retry_backoff_s=0.0)
            session = new_session(cfg, None)
            try:
                reg = Registry(cfg)
                (w,) = reg.all()
                w.health.healthy = True
                whole = Passthrough(cfg, reg, Picker("load", "load"), RouterMetrics(), session)
                answering.clear()
                task = asyncio.create_task(whole.complete("/v1/completions", b"{}", "rid",
                                                          Timings()))
                await asyncio.wait_for(answering.wait(), 5.0)
                await asyncio.sleep(0.05)  # the router reads the 503's headers (slow-body)
                assert w.accounting.inflight == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert w.accounting.inflight == 0 and w.accounting.drained.is_set(), name
            finally:
                await session.close()
