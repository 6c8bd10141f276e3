"""The router's HTTP surface: OpenAI endpoints, health, metrics, workers, admin.

`create_app(cfg, token, api_key)` builds one self-contained app: its HTTP client, registry,
metrics and tokenizer live in `RouterState`, created at startup and closed at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp

from splitserve.router.admin import add_admin_routes
from splitserve.router.config import RouterConfig
from splitserve.router.detok import text_stream
from splitserve.router.failures import UpstreamError
from splitserve.router.flow import Flow, Prefilled, Timings
from splitserve.router.formats import DONE, Joiner, error_body, request_id, sse, sse_comment
from splitserve.router.health import Registry
from splitserve.router.hotpath import HotRoutes
from splitserve.router.limits import BodyLimit
from splitserve.router.metrics import RouterMetrics
from splitserve.router.params import Kind, RequestError, plan_legs, unsplittable_reason, validate
from splitserve.router.policy import NoWorker, Overloaded, Picker
from splitserve.router.prompt import kv_bytes_per_token, load_tokenizer, render_chat
from splitserve.router.schema import CHAT_REQUEST, COMPLETION_REQUEST, openapi_body
from splitserve.router.whole import TRANSPORT_ERRORS, Passthrough, new_session

log = logging.getLogger("splitserve.router")
T = TypeVar("T")
TIMINGS_HEADER = "X-Splitserve-Timings"


class ClientGone(Exception):
    """The client disconnected before the response started."""


class GuardedStream(StreamingResponse):
    """A stream whose `cleanup` runs exactly once however the response ends — even when the
    client is gone before the body iterator starts (its own `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def once(fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    done = False

    async def run() -> None:
        nonlocal done
        if not done:
            done = True
            await fn()
    return run


@dataclass
class RouterState:
    cfg: RouterConfig
    token: str | None
    api_key: str | None
    client: httpx.AsyncClient
    registry: Registry
    metrics: RouterMetrics
    flow: Flow
    whole: Passthrough
    model: dict[str, Any]
    tokenizer: Any
    inflight: int = 0


def error_response(exc: RequestError | UpstreamError | NoWorker, rid: str) -> JSONResponse:
    headers = {"X-Request-Id": rid}
    if isinstance(exc, RequestError):
        return JSONResponse(error_body(exc.message, exc.err_type, exc.param, exc.status),
                            exc.status, headers=headers)
    if isinstance(exc, UpstreamError):
        return JSONResponse(exc.body, exc.status, headers=headers)
    if isinstance(exc, Overloaded):
        return JSONResponse(error_body(str(exc), "RateLimitError", None, 429), 429,
                            headers=headers | {"Retry-After": "1"})
    return JSONResponse(error_body(str(exc), "ServiceUnavailableError", None, 503), 503,
                        headers=headers | {"Retry-After": "1"})


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancellable(request: Request, work: Awaitable[T]) -> T:
    """Run `work` in this task, cancelling it (and so aborting its open leg) if the client goes
    away first; then raise ClientGone. One watcher task per call: this is on every request."""
    me = asyncio.current_task()
    assert me is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await until_disconnect(request)
        gone = True
        me.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside: not ours to absorb
        me.uncancel()
        raise ClientGone() from None
    finally:
        watcher.cancel()


def create_app(cfg: RouterConfig, token: str | None, api_key: str | None = None,
               startup_timeout_s: float = 300.0) -> ASGIApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(  # the registry's; it authenticates each request itself
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        registry = Registry(cfg, client, token)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                model = await registry.model()
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        await registry.check_all()
        model_dir = cfg.model_dir or model.get("root")
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        metrics = RouterMetrics()
        metrics.watch_workers(lambda: registry.workers.values())
        picker = Picker(cfg.prefill_policy, cfg.decode_policy, cfg.max_inflight_per_worker)
        session = new_session(cfg, token)  # both paths' legs; sends the token on every request
        flow = Flow(cfg, registry, picker, metrics, session, model["id"],
                    kv_bytes_per_token(model_dir), model.get("max_model_len"))
        whole = Passthrough(cfg, registry, picker, metrics, session)
        app.state.router = RouterState(cfg, token, api_key, client, registry, metrics, flow,
                                       whole, model, tokenizer)
        health = asyncio.create_task(registry.run())
        log.info("router on %s:%d serving %s", cfg.host, cfg.port, model["id"])
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await client.aclose()
            await session.close()

    app = FastAPI(title="splitserve router", lifespan=lifespan)

    def state(request: Request) -> RouterState:
        return request.app.state.router  # type: ignore[no-any-return]

    def authorized(request: Request, secret: str | None) -> bool:
        given = request.headers.get("authorization", "").encode()
        return secret is not None and hmac.compare_digest(given, f"Bearer {secret}".encode())

    @app.post("/v1/completions",
              openapi_extra=openapi_body(COMPLETION_REQUEST, "OpenAI text completion"))
    async def completions(request: Request) -> Response:
        return await serve_request(state(request), request, "completion")

    @app.post("/v1/chat/completions",
              openapi_extra=openapi_body(CHAT_REQUEST, "OpenAI chat completion"))
    async def chat_completions(request: Request) -> Response:
        return await serve_request(state(request), request, "chat")

    async def serve_request(st: RouterState, request: Request, kind: Kind) -> Response:
        rid = request_id(request.headers.get("x-request-id"))
        if st.api_key and not authorized(request, st.api_key):
            return JSONResponse(error_body("invalid API key", "AuthenticationError", None, 401),
                                401, headers={"X-Request-Id": rid})
        if st.inflight >= st.cfg.max_inflight:
            st.metrics.requests.labels(kind, "-", "rejected").inc()
            return JSONResponse(error_body("the router is at capacity", "RateLimitError", None,
                                           429), 429,
                                headers={"X-Request-Id": rid, "Retry-After": "1"})
        st.inflight += 1
        st.metrics.inflight.inc()
        handed_off = False
        mode = "-"
        try:
            raw = await request.body()
            try:
                parsed = json.loads(raw)
            except ValueError as exc:  # not JSON, or not UTF-8 at all
                raise RequestError(f"invalid JSON body: {exc}") from exc
            body = validate(parsed, kind, st.model["id"])
            mode = choose_mode(st, body, kind)
            t = Timings(mode=mode)
            if mode == "split":
                response = await split(st, request, body, kind, rid, t)
            else:
                response = await whole(st, request, body, raw, kind, rid, t)
            if isinstance(response, GuardedStream):
                handed_off = True  # the stream's cleanup closes the books
            else:
                finish(st, kind, mode, "ok" if response.status_code < 400 else "error", t)
            return response
        except (RequestError, UpstreamError, NoWorker) as exc:
            st.metrics.requests.labels(kind, mode, "error").inc()
            return error_response(exc, rid)
        except ClientGone:
            st.metrics.requests.labels(kind, mode, "cancelled").inc()
            return Response(status_code=499)
        finally:
            if not handed_off:
                st.inflight -= 1
                st.metrics.inflight.dec()

    def finish(st: RouterState, kind: str, mode: str, outcome: str, t: Timings) -> None:
        t.end = time.monotonic()
        st.metrics.requests.labels(kind, mode, outcome).inc()
        if outcome == "ok":
            st.metrics.observe_timings(t.as_dict())

    def choose_mode(st: RouterState, body: dict[str, Any], kind: Kind) -> str:
        reg = st.registry
        split_ready = bool(reg.routable("prefill") and reg.routable("decode"))
        if not split_ready:
            if not (reg.routable("colocated") or reg.routable("decode")):
                raise NoWorker("prefill/decode or colocated")
            return "whole"
        reason = unsplittable_reason(body, kind)
        if reason is None:
            return "split"
        if st.cfg.unsplittable == "refuse":
            raise RequestError(
                f"parameter `{reason}` cannot be honoured exactly when prefill and decode run "
                "on different workers; remove it, or start the router with "
                "--unsplittable whole", reason)
        return "whole"

    async def split(st: RouterState, request: Request, body: dict[str, Any], kind: Kind,
                    rid: str, t: Timings) -> Response:
        if kind == "chat":
            prompt: str | list[int] = render_chat(st.tokenizer, body)
        else:
            prompt = body["prompt"]
        legs = plan_legs(body, kind, prompt)
        pre = await cancellable(request, st.flow.prefill(legs, rid, t))
        joiner = Joiner(legs, rid, st.model["id"])
        joiner.text_stream = text_stream(st.tokenizer, pre.prompt_ids, body)
        start = joiner.start(pre.prompt_ids, pre.fingerprint)
        first = joiner.tokens(pre.t1_text, pre.t1_ids, pre.finish_reason, pre.stop_reason)
        if not legs.stream:
            try:
                t.first_sent = time.monotonic()
                if pre.decode is not None:
                    await cancellable(request, drain(st.flow.decode(legs, rid, pre, joiner, t)))
            finally:
                st.flow.release(pre)
            await st.flow.transfer_record(t)
            t.end = time.monotonic()
            return JSONResponse(joiner.response(), headers={
                "X-Request-Id": rid, TIMINGS_HEADER: json.dumps(t.as_dict())})
        outcome = ["cancelled"]

        async def events() -> AsyncIterator[bytes]:
            try:
                t.first_sent = time.monotonic()
                yield b"".join(sse(ev) for ev in (*start, first))
                if pre.decode is not None:
                    if joiner.text_stream is not None:  # at D's leg's first wait, not before it
                        asyncio.get_running_loop().call_soon(joiner.text_stream.prime)
                    async for chunk in st.flow.decode(legs, rid, pre, joiner, t):
                        if t.t2_sent is None:
                            t.t2_sent = time.monotonic()
                        yield sse(chunk)
                for ev in joiner.end():
                    yield sse(ev)
                await st.flow.transfer_record(t)
                t.end = time.monotonic()
                yield sse_comment("splitserve-timings", t.as_dict())
                yield DONE
                outcome[0] = "ok"
            except (UpstreamError, NoWorker) as exc:
                outcome[0] = "error"
                err = exc.body if isinstance(exc, UpstreamError) else error_body(
                    str(exc), "ServiceUnavailableError", None, 503)
                yield sse(err)
                yield DONE

        return GuardedStream(events(), once(lambda: close_split(st, kind, pre, outcome[0], t)),
                             media_type="text/event-stream", headers={"X-Request-Id": rid})

    async def close_split(st: RouterState, kind: str, pre: Prefilled, outcome: str,
                          t: Timings) -> None:
        st.flow.release(pre)
        finish(st, kind, "split", outcome, t)
        st.inflight -= 1
        st.metrics.inflight.dec()

    async def whole(st: RouterState, request: Request, body: dict[str, Any], raw: bytes,
                    kind: Kind, rid: str, t: Timings) -> Response:
        """The request unchanged (its very bytes) on one worker."""
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        headers = {"X-Request-Id": rid}
        if not body.get("stream"):
            status, content, ctype = await cancellable(
                request, st.whole.complete(path, raw, rid, t))
            t.first_sent = time.monotonic()
            return Response(content, status, headers=headers, media_type=ctype)
        r, w = await cancellable(request, st.whole.open(path, raw, rid, t))
        if r.status != 200:
            try:
                content = await r.read()
            finally:
                r.release()
                w.release()
            return Response(content, r.status, headers=headers,
                            media_type=r.headers.get("Content-Type"))

        outcome = ["cancelled"]

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for piece in r.content.iter_any():
                    if t.first_sent is None:
                        t.first_sent = time.monotonic()
                    yield piece
                outcome[0] = "ok"
            except TRANSPORT_ERRORS as exc:
                outcome[0] = "error"
                yield sse(error_body(f"worker stream failed: {exc}", "UpstreamError", None, 502))
                yield DONE

        async def close() -> None:
            if outcome[0] == "ok":
                r.release()  # read to the end: the connection goes back to the pool
            else:
                r.close()  # closing mid-stream aborts the request in vLLM
            w.release()
            finish(st, kind, "whole", outcome[0], t)
            st.inflight -= 1
            st.metrics.inflight.dec()

        return GuardedStream(relay(), once(close), media_type="text/event-stream",
                             headers=headers)

    # --- everything else --------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [state(request).model]})

    @app.get("/health")
    async def health(request: Request) -> Response:
        reg = state(request).registry
        ok = bool(reg.routable("prefill") and reg.routable("decode")) or bool(
            reg.routable("colocated"))
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state(request).metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers(request: Request) -> JSONResponse:
        return JSONResponse({"workers": [w.describe() for w in
                                         state(request).registry.workers.values()]})

    add_admin_routes(app, state, authorized)

    hot = HotRoutes(app, {"/v1/completions": completions,
                          "/v1/chat/completions": chat_completions})
    return BodyLimit(hot, max_bytes=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)


async def drain(gen: AsyncIterator[Any]) -> None:
    async for _ in gen:
        pass
