"""The router's HTTP surface: the OpenAI endpoints (`endpoints`), health, metrics, workers and
admin routes over one `RouterState`, created at startup and closed at shutdown.

`create_app(cfg, token, api_key)` builds one self-contained ASGI app.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp

from splitserve.common.vocab import Pool
from splitserve.router.admin import add_admin_routes, add_peer_routes
from splitserve.router.config import RouterConfig
from splitserve.router.endpoints import authorized, chat_completions, completions, state
from splitserve.router.formats import error_body
from splitserve.router.hotpath import HotRoutes
from splitserve.router.limits import BodyLimit
from splitserve.router.schema import CHAT_REQUEST, COMPLETION_REQUEST, openapi_body
from splitserve.router.state import close_state, open_state


def create_app(cfg: RouterConfig, token: str | None, api_key: str | None = None,
               startup_timeout_s: float = 300.0) -> ASGIApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.router = await open_state(cfg, token, api_key, startup_timeout_s)
        # The collector, tuned for a process that holds a thousand open streams (the app owns
        # its process: `splitserve router` serves it alone). What startup left alive (modules,
        # the tokenizer) is frozen out of its reach, and its generations fill 14x / 2x / 2x
        # slower: a full collection stops every stream while it walks every tracked object
        # (gap p99 at 1,000 streams: 350 ms with the defaults, 58 ms so;
        # benchmarks/router_capacity.py). Cycles are still collected.
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 20, 20)
        try:
            yield
        finally:
            await close_state(app.state.router)

    app = FastAPI(title="splitserve router", lifespan=lifespan)
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      openapi_extra=openapi_body(COMPLETION_REQUEST, "OpenAI text completion"))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                      openapi_extra=openapi_body(CHAT_REQUEST, "OpenAI chat completion"))
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/workers", workers, methods=["GET"])
    add_admin_routes(app, state, authorized)
    add_peer_routes(app, state, authorized)
    hot = HotRoutes(app, {"/v1/completions": completions,
                          "/v1/chat/completions": chat_completions})
    return BodyLimit(hot, max_bytes=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)


async def models(request: Request) -> JSONResponse:
    """The served model; behind the API key when one is set, as vLLM guards every /v1 path."""
    st = state(request)
    if st.api_key and not authorized(request, st.api_key):
        return JSONResponse(error_body("invalid API key", "AuthenticationError", None, 401), 401)
    return JSONResponse({"object": "list", "data": [st.model]})


async def health(request: Request) -> Response:
    """200 while a P and a D, or a colocated worker, are in rotation."""
    reg = state(request).registry
    ok = bool(reg.routable(Pool.PREFILL) and reg.routable(Pool.DECODE)) or bool(
        reg.routable(Pool.COLOCATED))
    return Response(status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(state(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


async def workers(request: Request) -> JSONResponse:
    """Every worker (`RouterState.describe`), the cache index's size and rebuild time, and the
    peer routers whose open legs this one counts."""
    st = state(request)
    return JSONResponse({"workers": [st.describe(w) for w in st.registry.all()],
                         "kv_index": None if st.cache is None else st.cache.summary(),
                         "peers": [] if st.peers is None else st.peers.describe()})
