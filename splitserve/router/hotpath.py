"""The hot routes, dispatched ahead of FastAPI's router.

FastAPI still declares every route (its OpenAPI schema documents them; it serves them too if
reached), but the two OpenAI POST routes — nearly all of a router's traffic — go straight from
here to their handlers, skipping Starlette's routing and FastAPI's per-request machinery (about
0.25 ms a request on this machine, a third of what the router adds). Everything else, and the
lifespan, passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from starlette.types import Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    def __init__(self, app: FastAPI, routes: dict[str, Handler]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
            if handler is not None:
                scope["app"] = self.app  # `request.app.state` as under FastAPI
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
