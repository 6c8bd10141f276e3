"""Scripted workers (small aiohttp servers on loopback) and a `Flow` over them, for the tests
of the two legs that pin failure paths down exactly."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from splitserve.common.wire import WorkerInfo
from splitserve.router.config import RouterConfig
from splitserve.router.flow import Flow
from splitserve.router.formats import Joiner
from splitserve.router.http import new_session
from splitserve.router.legs import LegProtocols, leg_protocols
from splitserve.router.metrics import RouterMetrics
from splitserve.router.params import Legs
from splitserve.router.policy import Picker
from splitserve.router.registry import Registry
from splitserve.router.worker import Worker

Handler = Callable[[str, web.Request], Awaitable[web.StreamResponse]]
PREFILL_OK = {"choices": [{"text": "a", "token_ids": [10], "prompt_token_ids": [1, 2, 3],
                           "finish_reason": "length", "stop_reason": None}],
              "system_fingerprint": "fp"}


def identify(worker: Worker, raw: dict[str, Any] | None) -> None:
    """Give `worker` the `/splitserve/info` answer `raw` (role: its pool's), as the health loop
    would: `{}` is a plain vLLM worker (404), None one not read yet."""
    role = "prefill" if worker.pool == "prefill" else "decode"
    worker.identity.plain = raw == {}
    worker.identity.info = WorkerInfo.from_json({"role": role} | raw) if raw else None


def chunk(text: str, tok: int, finish: str | None = None) -> bytes:
    c = {"choices": [{"index": 0, "text": text, "token_ids": [tok], "finish_reason": finish,
                      "stop_reason": None}]}
    return f"data: {json.dumps(c)}\n\n".encode()


async def sse_reply(request: web.Request, parts: list[bytes], cut: bool = False
                    ) -> web.StreamResponse:
    """Stream `parts`; then end like vLLM (`[DONE]`), or die mid-body like a crashed worker."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for p in parts:
        await resp.write(p)
    if cut:
        assert request.transport is not None
        request.transport.close()  # the chunked body never ends: the client sees it cut
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def workers(handler: Handler, names: tuple[str, ...]) -> AsyncIterator[dict[str, str]]:
    """One scripted worker per name; `handler(name, request)` answers for each of them."""
    servers: list[TestServer] = []
    urls: dict[str, str] = {}
    try:
        for name in names:
            app = web.Application()

            async def route(request: web.Request, name: str = name) -> web.StreamResponse:
                return await handler(name, request)

            app.router.add_route("*", "/{tail:.*}", route)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append(server)
            urls[name] = f"http://127.0.0.1:{server.port}"
        yield urls
    finally:
        for server in servers:
            await server.close()


@asynccontextmanager
async def make_flow(urls: dict[str, str], token: str | None = None,
                    protocols: Callable[[Any], LegProtocols] | None = None
                    ) -> AsyncIterator[tuple[Flow, RouterMetrics]]:
    """A Flow over scripted workers (`p…`, `d…`, `c…` by name), every worker in rotation.
    `protocols(session)`: the leg protocols (default: the router's own)."""
    role = {"p": "prefill", "d": "decode", "c": "colocated"}
    by_role = {r: tuple(u for n, u in urls.items() if role[n[0]] == r) for r in role.values()}
    cfg = RouterConfig(prefill=by_role["prefill"], decode=by_role["decode"],
                       colocated=by_role["colocated"], retry_backoff_s=0.0)
    session = new_session(cfg, token)
    try:
        reg = Registry(cfg)  # its health loop is not run here
        for w in reg.all():
            w.health.healthy = True
        metrics = RouterMetrics()
        legs = (protocols(session) if protocols is not None
                else leg_protocols(session, token, cfg.kv_transport))
        yield Flow(cfg, reg, Picker("load", "load"), metrics, session, "m", 0, 2048,
                   legs), metrics
    finally:
        await session.close()


def started(legs: Legs, pre: Any) -> Joiner:
    joiner = Joiner(legs, "rid", "m")
    joiner.start(pre.prompt_ids, pre.fingerprint)
    joiner.tokens(pre.t1_text, pre.t1_ids, None, None)
    return joiner
