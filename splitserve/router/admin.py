"""The admin endpoint: add, drain and remove workers at runtime, set the peer routers, and
serve this router's open legs to its peers (deployment token required on every route).

Removal drains first and waits for the worker's open legs, so no request is lost. Adding a worker
may name its `node`; adding one already registered in that role with a `node` only sets the
node (200), so a launcher can label the workers the router started with.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from splitserve.router.formats import error_body
from splitserve.router.peers import LOAD_ROUTE, RouterLoad


def needs_token(what: str) -> JSONResponse:
    """The 401 answer of a route that takes only the deployment token."""
    return JSONResponse(error_body(f"{what} needs the deployment token", "AuthenticationError",
                                   None, 401), 401)


def add_admin_routes(app: FastAPI, state: Callable[[Request], Any],
                     authorized: Callable[[Request, str | None], bool]) -> None:
    async def admin_body(request: Request) -> dict[str, Any] | JSONResponse:
        if not authorized(request, state(request).token):
            return needs_token("the admin endpoint")
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or not isinstance(body.get("url"), str):
                raise ValueError("expected {\"url\": ...}")
            return body
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), param="url"), 400)

    async def admin_targets(request: Request) -> tuple[dict[str, Any], list[Any]] | JSONResponse:
        """The request's body and the workers it names, or the error answer."""
        body = await admin_body(request)
        if isinstance(body, JSONResponse):
            return body
        found = state(request).registry.find(body["url"], body.get("role"))
        if not found:
            return JSONResponse(error_body("unknown worker", "NotFoundError", "url", 404), 404)
        return body, found

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> JSONResponse:
        body = await admin_body(request)
        if isinstance(body, JSONResponse):
            return body
        st = state(request)
        reg = st.registry
        node = body.get("node")
        if node is not None and not isinstance(node, str):
            return JSONResponse(error_body("node must be a string", param="node"), 400)
        known = reg.find(body["url"], str(body.get("role", "")))
        if known and node is not None:
            reg.set_node(known[0], node)
            return JSONResponse(st.describe(known[0]), 200)
        try:
            worker = reg.add(body["url"], str(body.get("role", "")), node)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), param="url"), 400)
        await st.checks.check(worker)
        return JSONResponse(st.describe(worker), 201)

    @app.post("/admin/workers/drain")
    async def drain_worker(request: Request) -> JSONResponse:
        targets = await admin_targets(request)
        if isinstance(targets, JSONResponse):
            return targets
        body, found = targets
        st = state(request)
        for worker in found:
            st.registry.drain(worker, draining=not body.get("undrain", False))
        return JSONResponse({"workers": [st.describe(w) for w in found]})

    @app.post("/admin/workers/remove")
    async def remove_worker(request: Request) -> JSONResponse:
        targets = await admin_targets(request)
        if isinstance(targets, JSONResponse):
            return targets
        _, found = targets
        st = state(request)
        try:
            removed = await asyncio.gather(*(st.registry.remove(w) for w in found))
        except TimeoutError:
            return JSONResponse(error_body("worker still busy after the drain timeout",
                                           "TimeoutError", "url", 504), 504)
        return JSONResponse({"workers": [st.describe(w) | {"removed": True} for w in removed]})



def add_peer_routes(app: FastAPI, state: Callable[[Request], Any],
                    authorized: Callable[[Request, str | None], bool]) -> None:
    """This router's open legs for its peers, and the peer list (`router.peers`)."""

    @app.get(LOAD_ROUTE)
    async def router_load(request: Request) -> JSONResponse:
        """This router's open legs per worker, for its peers (`router.peers`)."""
        st = state(request)
        if not authorized(request, st.token):
            return needs_token("the router's load")
        return JSONResponse(RouterLoad.of(st.registry.all()).to_json())

    @app.put("/admin/peers")
    async def set_peers(request: Request) -> JSONResponse:
        """`{"peers": [URL, ...]}`: the other routers over these workers, from now on."""
        st = state(request)
        if not authorized(request, st.token):
            return needs_token("the admin endpoint")
        try:
            body = json.loads(await request.body())
            urls = body.get("peers") if isinstance(body, dict) else None
            if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                raise ValueError("expected {\"peers\": [URL, ...]}")
            st.peers.set(urls)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), param="peers"), 400)
        return JSONResponse({"peers": st.peers.describe()})
