"""A reverse proxy in front of one real worker (aiohttp, in a thread of the test process), so a
test can cut what a router reads of the worker without touching the worker: with `cut_kv`
set, the cache report's routes (`/splitserve/kv/...`) get their connection closed, while
health, load, info and the legs pass through. Whole bodies only (no streams): put it in front
of a P-worker, whose leg is one JSON answer."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
from aiohttp import web

from splitserve.worker.launch import free_port

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


class Proxy:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cut_kv = False
        self.kv_cut = 0  # kv requests cut so far
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Proxy:
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024**2)

        async def forward(request: web.Request) -> web.StreamResponse:
            if self.cut_kv and request.path.startswith("/splitserve/kv/"):
                self.kv_cut += 1
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=502)
            headers: dict[str, Any] = {k: v for k, v in request.headers.items()
                                       if k.lower() not in HOP_HEADERS}
            async with session.request(request.method, self.target + request.path_qs,
                                       headers=headers, data=await request.read()) as r:
                body = await r.read()
                out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
                return web.Response(status=r.status, body=body, headers=out)

        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await session.close()
