"""The OpenAI endpoints, in the order a request meets them: authenticate, admit, parse, choose
the path, run it (the two legs, or the whole request on one worker), answer.

Invariants:
- Every admitted request holds one place in the router's open-request count (`Admission`),
  given back exactly once, with its outcome counted: by `serve_request` for an answer that is
  complete when returned, by the stream's cleanup for a stream.
- A client that leaves cancels the leg that is open (`cancellable`, or the stream's cleanup);
  closing a leg's connection aborts its request in vLLM, so no worker keeps KV for it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.common.vocab import Pool
from splitserve.router.detok import text_stream
from splitserve.router.failures import UpstreamError
from splitserve.router.flow import Prefilled
from splitserve.router.formats import DONE, Joiner, error_body, request_id, sse, sse_comment
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.params import (
    Kind,
    Legs,
    RequestError,
    check_budget,
    max_tokens_of,
    plan_legs,
    unsplittable_reason,
)
from splitserve.router.params import validate as validate_body
from splitserve.router.policy import NoWorker, Overloaded
from splitserve.router.prompt import (
    OTHER_TEMPLATE,
    completion_prompt,
    plain_conversation,
    render_chat,
)
from splitserve.router.state import RouterState
from splitserve.router.timings import Timings
from splitserve.router.worker import Worker

T = TypeVar("T")
TIMINGS_HEADER = "X-Splitserve-Timings"


def state(request: Request) -> RouterState:
    router: RouterState = request.app.state.router
    return router


def authorized(request: Request, secret: str | None) -> bool:
    given = request.headers.get("authorization", "").encode()
    return secret is not None and hmac.compare_digest(given, f"Bearer {secret}".encode())


async def completions(request: Request) -> Response:
    return await serve_request(state(request), request, "completion")


async def chat_completions(request: Request) -> Response:
    return await serve_request(state(request), request, "chat")


class Admission:
    """One admitted request's place in the open-request count: taken on creation, given back
    by the first `close`, which counts the request by endpoint, path and outcome."""

    def __init__(self, st: RouterState, kind: Kind) -> None:
        self.st = st
        self.kind = kind
        self.mode = "-"  # the path, once chosen
        self.outcome = "cancelled"  # a stream's, until it ends otherwise
        self.closed = False
        st.inflight += 1
        st.metrics.inflight.inc()

    def close(self, outcome: str | None = None, t: Timings | None = None) -> None:
        """Give the place back; count `outcome` (with `t`'s timings when it is "ok")."""
        if self.closed:
            return
        self.closed = True
        if outcome is not None:
            if t is not None:
                t.end = time.monotonic()
            self.st.metrics.requests.labels(self.kind, self.mode, outcome).inc()
            if outcome == "ok" and t is not None:
                self.st.metrics.observe_timings(t.as_dict())
        self.st.inflight -= 1
        self.st.metrics.inflight.dec()


async def serve_request(st: RouterState, request: Request, kind: Kind) -> Response:
    rid = request_id(request.headers.get("x-request-id"))
    if st.api_key and not authorized(request, st.api_key):
        return JSONResponse(error_body("invalid API key", "AuthenticationError", None, 401),
                            401, headers={"X-Request-Id": rid})
    if st.inflight >= st.cfg.max_inflight:
        st.metrics.requests.labels(kind, "-", "rejected").inc()
        return JSONResponse(error_body("the router is at capacity", "RateLimitError", None, 429),
                            429, headers={"X-Request-Id": rid, "Retry-After": "1"})
    admission = Admission(st, kind)
    handed_off = False
    try:
        raw = await request.body()
        try:
            parsed = json.loads(raw)
        except ValueError as exc:  # not JSON, or not UTF-8 at all
            raise RequestError(f"invalid JSON body: {exc}") from exc
        body = validate_body(parsed, kind, st.model["id"])
        choice = choose_mode(st, body, kind)
        admission.mode = choice.mode
        t = Timings(mode=choice.mode)
        if choice.mode == "split":
            response = await split(st, request, body, raw, kind, rid, t, admission,
                                   choice.messages)
        else:
            response = await whole(st, request, body, raw, kind, rid, t, admission)
        if isinstance(response, GuardedStream):
            handed_off = True  # the stream's cleanup closes the admission
        else:
            admission.close("ok" if response.status_code < 400 else "error", t)
        return response
    except (RequestError, UpstreamError, NoWorker) as exc:
        admission.close("error")
        return error_response(exc, rid)
    except ClientGone:
        admission.close("cancelled")
        return Response(status_code=499)
    finally:
        if not handed_off:
            admission.close()  # a no-op once counted above


@dataclass(frozen=True)
class Choice:
    """How one request runs, decided once: `mode` ("split" | "whole"); for a chat split by the
    router, `messages` as the workers' template sees them (`prompt.plain_conversation`), which
    the router renders, so what was checked is what is rendered."""

    mode: str
    messages: list[dict[str, Any]] | None = None


def choose_mode(st: RouterState, body: dict[str, Any], kind: Kind) -> Choice:
    """`split` when a P and a D are in rotation (a P alone for a request of one token, which
    never reaches D) and the request's parameters mean the same on two workers; else `whole`
    (or a 400 under `--unsplittable refuse`)."""
    reg = st.registry
    split_ready = bool(reg.routable(Pool.PREFILL) and (
        reg.routable(Pool.DECODE) or max_tokens_of(body, kind) == 1))
    if not split_ready:
        if not (reg.routable(Pool.COLOCATED) or reg.routable(Pool.DECODE)):
            raise NoWorker("prefill/decode or colocated")
        return Choice("whole")
    reason = unsplittable_reason(body, kind)
    messages = None
    if reason is None and kind == "chat" and st.tokenizer is not None:
        fmt = st.chat_format()
        messages = None if fmt == OTHER_TEMPLATE else plain_conversation(body["messages"], fmt)
        if fmt == OTHER_TEMPLATE:
            reason = "chat_template"  # the workers render from another template than ours
        elif messages is None:
            reason = "messages"  # tool calls, images, roles vLLM rewrites: its own rendering
    if reason is None:
        return Choice("split", messages)
    if st.cfg.unsplittable == "refuse" and reason == "chat_template":
        raise RequestError(
            "the prefill and decode workers render chats from another chat template than the "
            "router's tokenizer (their --chat-template or --default-chat-template-kwargs), so "
            "a chat cannot be split exactly; start the router with --unsplittable whole",
            "messages")
    if st.cfg.unsplittable == "refuse":
        raise RequestError(
            f"parameter `{reason}` cannot be honoured exactly when prefill and decode run "
            "on different workers; remove it, or start the router with "
            "--unsplittable whole", reason)
    return Choice("whole")


# --- the two legs -------------------------------------------------------------------------
async def split(st: RouterState, request: Request, body: dict[str, Any], raw: bytes,
                kind: Kind, rid: str, t: Timings, admission: Admission,
                messages: list[dict[str, Any]] | None = None) -> Response:
    """P's leg (t1), then D's: one JSON answer, or one stream that starts with t1. Or, when
    the chosen D holds all but a few of the prompt's tokens (`Flow.plan`), D's leg alone from
    the prompt: prefill on D, counted as mode `local`, resumed on another D like any D leg.
    A chat is rendered from `messages` (`Choice.messages`)."""
    prompt = (render_chat(st.tokenizer, body, messages) if kind == "chat"
              else completion_prompt(st.tokenizer, body, st.prompt_chars_limit))
    legs = plan_legs(body, kind, prompt, st.flow.max_model_len, st.chat_max_tokens)
    check_budget(body, legs)
    plan = st.flow.plan(legs)
    if plan.local:
        admission.mode = t.mode = "local"
        t.cached = {"d_cached": plan.local_reused}
        st.flow.count_local(plan)
        pre = st.flow.local(plan)
    else:
        pre = await cancellable(request, st.flow.prefill(legs, rid, t, plan))
    joiner = Joiner(legs, rid, st.model["id"])
    joiner.text_stream = text_stream(st.tokenizer, pre.prompt_ids, body)
    head = joiner.start(pre.prompt_ids, pre.fingerprint)
    if not plan.local:
        head.append(joiner.tokens(pre.t1_text, pre.t1_ids, pre.finish_reason, pre.stop_reason))
    if not legs.stream:
        try:
            t.first_sent = None if plan.local else time.monotonic()
            if pre.decode is not None:
                await cancellable(request, drain(st.flow.decode(legs, rid, pre, joiner, t)))
        finally:
            st.flow.release(pre)
        await st.flow.transfer_record(t)
        t.end = time.monotonic()
        t.first_sent = t.first_sent or t.end
        return JSONResponse(joiner.response(), headers={
            "X-Request-Id": rid, TIMINGS_HEADER: json.dumps(t.as_dict())})

    async def cleanup() -> None:
        st.flow.release(pre)
        admission.close(admission.outcome, t)

    return GuardedStream(
        split_events(st, legs, rid, pre, joiner, t, b"".join(sse(ev) for ev in head),
                     admission, first_from_d=plan.local),
        cleanup, media_type="text/event-stream", headers={"X-Request-Id": rid})


async def split_events(st: RouterState, legs: Legs, rid: str, pre: Prefilled, joiner: Joiner,
                       t: Timings, head: bytes, admission: Admission, first_from_d: bool = False
                       ) -> AsyncIterator[bytes]:
    """The client's stream: t1 at once (`first_from_d`: no t1, the first token is D's), D's
    tokens as they come, usage, timings, `[DONE]`; an OpenAI error event when D cannot
    finish."""
    try:
        if not first_from_d:
            t.first_sent = time.monotonic()
        if head:
            yield head
        if pre.decode is not None:
            if joiner.text_stream is not None:  # at D's leg's first wait, not before it
                asyncio.get_running_loop().call_soon(joiner.text_stream.prime)
            async for chunk in st.flow.decode(legs, rid, pre, joiner, t):
                if t.first_sent is None:
                    t.first_sent = time.monotonic()
                elif t.t2_sent is None and not first_from_d:
                    t.t2_sent = time.monotonic()
                yield sse(chunk)
        for ev in joiner.end():
            yield sse(ev)
        await st.flow.transfer_record(t)
        t.end = time.monotonic()
        yield sse_comment("splitserve-timings", t.as_dict())
        yield DONE
        admission.outcome = "ok"
    except (UpstreamError, NoWorker) as exc:
        admission.outcome = "error"
        err = exc.body if isinstance(exc, UpstreamError) else error_body(
            str(exc), "ServiceUnavailableError", None, 503)
        yield sse(err)
        yield DONE


# --- the whole request on one worker ------------------------------------------------------
async def whole(st: RouterState, request: Request, body: dict[str, Any], raw: bytes, kind: Kind,
                rid: str, t: Timings, admission: Admission) -> Response:
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

    async def cleanup() -> None:
        if admission.outcome == "ok":
            r.release()  # read to the end: the connection goes back to the pool
        else:
            r.close()  # closing mid-stream aborts the request in vLLM
        w.release()
        admission.close(admission.outcome, t)

    return GuardedStream(whole_events(r, w, t, admission), cleanup,
                         media_type="text/event-stream", headers=headers)


async def whole_events(r: aiohttp.ClientResponse, w: Worker, t: Timings, admission: Admission
                       ) -> AsyncIterator[bytes]:
    """The worker's stream as is; an OpenAI error event if it breaks."""
    try:
        async for piece in r.content.iter_any():
            if t.first_sent is None:
                t.first_sent = time.monotonic()
            yield piece
        admission.outcome = "ok"
    except TRANSPORT_ERRORS as exc:
        admission.outcome = "error"
        yield sse(error_body(f"worker stream failed: {exc}", "UpstreamError", None, 502))
        yield DONE


# --- helpers ------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client disconnected before the response started."""


class GuardedStream(StreamingResponse):
    """A stream whose `cleanup` runs exactly once however the response ends — even when the
    client is gone before the body iterator starts (its own `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup: Callable[[], Awaitable[None]] | None = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cleanup, self._cleanup = self._cleanup, None
            if cleanup is not None:
                await cleanup()


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


async def drain(gen: AsyncIterator[Any]) -> None:
    async for _ in gen:
        pass
