"""Scripted workers (small aiohttp servers on loopback) and a `Flow` over them, for the tests
of the two legs that pin failure paths down exactly, and a scripted cache report
(`ScriptedCache`) for the tests of the router's cache view."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from splitserve.common.wire import WorkerInfo
from splitserve.kvindex.keys import prefix_keys
from splitserve.kvindex.messages import (
    EVENTS_PATH,
    SNAPSHOT_PATH,
    KvChange,
    KvEvents,
    KvSnapshot,
)
from splitserve.router.cacheview import Follow
from splitserve.router.config import RouterConfig
from splitserve.router.flow import Flow
from splitserve.router.formats import Joiner
from splitserve.router.http import new_session
from splitserve.router.legs import LegProtocols, leg_protocols
from splitserve.router.metrics import RouterMetrics
from splitserve.router.params import Legs, plan_legs
from splitserve.router.policy import Picker
from splitserve.router.registry import Registry
from splitserve.router.timings import Timings
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


async def split_once(flow: Flow, max_tokens: int
                     ) -> tuple[list[dict[str, Any]], Joiner, Timings]:
    """One streamed completion (prompt "x", `max_tokens`) through `flow`'s two legs: the
    client's chunks after t1, the joiner and the timings. Every worker's hold is given back."""
    legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": max_tokens, "stream": True},
                     "completion", "x")
    pre = await flow.prefill(legs, "rid", t := Timings())
    joiner = started(legs, pre)
    out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    assert all(w.inflight == 0 for w in flow.registry.workers.values())
    return out, joiner, t


# The cache view's pace for tests: short long polls, quick retries.
FAST_FOLLOW = Follow(wait_s=0.2, timeout_s=2.0, recheck_s=0.2, inexact_min_s=0.05,
                     backoff_min_s=0.02, backoff_max_s=0.1)


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `cond()` holds (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class ScriptedCache:
    """One scripted worker's cache report: the two routes of `kvindex.messages` over a key set
    the test changes (`store`, `remove`, `clear`, `restart`), with the faults a router must
    survive: `gone` (the next events read answers 410), `skip` (the next change's seq jumps,
    a gap), `reporting=False` (404 on both routes), `down` (the connection is cut), `garbage`
    (the next events read answers these bytes as JSON's content). With
    `check_epoch` (the workers' contract), a reader of another epoch, or ahead of the worker,
    gets 410; without it, the answer's own epoch tells the reader. `exact=False`: the report
    cannot vouch for the engine's cache (`exact: false` snapshots, 410 on events).
    `two_lives=True`: two engines' reports behind one URL, each request answered by the other
    (a snapshot of one epoch, then 410 from the other).
    `handle(request)` answers the two routes (None for any other path)."""

    def __init__(self, block_size: int = 4, epoch: str = "e1", retain: int = 1000,
                 check_epoch: bool = True) -> None:
        self.block_size, self.epoch, self.retain = block_size, epoch, retain
        self.check_epoch = check_epoch  # 410 to a reader of another epoch, or ahead
        self.keys: set[int] = set()
        self.changes: list[KvChange] = []
        self.seq = 0
        self.gone = False
        self.skip = False
        self.reporting = True
        self.exact = True  # False: the report cannot vouch (empty snapshot, 410 on events)
        self.down = False
        self.garbage: bytes | None = None
        self.two_lives = False
        self.asked: list[str] = []
        self._changed: asyncio.Event | None = None

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def change(self, stored: Iterable[int] = (), removed: Iterable[int] = (),
               cleared: bool = False) -> KvChange:
        self.seq += 2 if self.skip else 1
        self.skip = False
        c = KvChange(self.seq, time.time(), tuple(stored), tuple(removed), cleared)
        if cleared:
            self.keys.clear()
        self.keys.difference_update(c.removed)
        self.keys.update(c.stored)
        self.changes = [*self.changes, c][-self.retain:]
        self._notify()
        return c

    def store(self, token_ids: list[int]) -> KvChange:
        """The engine cached every full block of `token_ids`."""
        return self.change(stored=prefix_keys(token_ids, self.block_size))

    def restart(self, epoch: str) -> None:
        """A new life of the engine: nothing cached, changes start over."""
        self.epoch, self.seq, self.changes = epoch, 0, []
        self.keys.clear()
        self._notify()

    def snapshot(self) -> KvSnapshot:
        if not self.exact:
            return KvSnapshot(self.epoch, self.seq, self.block_size, (), False, "events lost")
        return KvSnapshot(self.epoch, self.seq, self.block_size, tuple(sorted(self.keys)))

    async def handle(self, request: web.Request) -> web.StreamResponse | None:
        if request.path not in (SNAPSHOT_PATH, EVENTS_PATH):
            return None
        self.asked.append(request.path_qs)
        if self.down:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if not self.reporting:
            return web.Response(status=404)
        if request.path == SNAPSHOT_PATH:
            snapshot = self.snapshot()
            if self.two_lives:  # the next request reaches the other engine
                self.epoch = "other-" + self.epoch if not self.epoch.startswith(
                    "other-") else self.epoch.removeprefix("other-")
            return web.json_response(snapshot.to_json())
        after = int(request.query["after"])
        wait_s = float(request.query.get("wait_s", "0"))
        if self.gone:
            self.gone = False
            return web.Response(status=410)
        if self.garbage is not None:
            body, self.garbage = self.garbage, None
            return web.Response(body=body, content_type="application/json")
        epoch = request.query.get("epoch")

        def other_life() -> bool:
            return self.check_epoch and (after > self.seq or epoch not in (None, self.epoch))

        if other_life() or not self.exact:
            return web.Response(status=410)
        if self.seq == after and wait_s > 0:  # nothing new yet
            self._changed = self._changed or asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
        if other_life() or not self.exact or (self.changes
                                               and after < self.changes[0].seq - 1):
            return web.Response(status=410)
        out = KvEvents(self.epoch, max(self.seq, after), self.block_size,
                       tuple(c for c in self.changes if c.seq > after))
        return web.json_response(out.to_json())
