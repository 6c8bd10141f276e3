"""Request bodies are bounded in size and time before the router's handlers see them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from splitserve.router.limits import BodyLimit

LIMIT = 1000


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"received": len(body)})


def app(timeout_s: float = 5.0) -> Any:
    inner = Starlette(routes=[Route("/v1/completions", echo, methods=["POST", "GET"])])
    return BodyLimit(inner, max_bytes=LIMIT, timeout_s=timeout_s)


async def call(asgi: Any, chunks: list[bytes], headers: list[tuple[bytes, bytes]],
               delay_s: float = 0.0) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Drive the ASGI app as a server would: the body in `chunks`, `delay_s` between them."""
    sent: list[dict[str, Any]] = []
    queue = list(chunks)

    async def receive() -> dict[str, Any]:
        if not queue:
            await asyncio.sleep(3600)  # the client keeps the connection open
        await asyncio.sleep(delay_s)
        chunk = queue.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    await asyncio.wait_for(asyncio.ensure_future(asgi(scope, receive, send)), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    hdrs = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], json.loads(body), hdrs


@pytest.mark.asyncio
async def test_a_body_within_the_limit_reaches_the_handler_whole() -> None:
    status, body, _ = await call(app(), [b"x" * 600, b"y" * 400], [])
    assert status == 200 and body == {"received": 1000}


@pytest.mark.asyncio
async def test_a_declared_oversize_body_is_refused_before_it_is_read() -> None:
    headers = [(b"content-length", b"5000"), (b"x-request-id", b"big-1")]
    status, body, hdrs = await call(app(), [], headers)  # no body chunk is ever offered
    assert status == 413 and body["error"]["type"] == "RequestTooLargeError"
    assert hdrs["x-request-id"] == "big-1"


@pytest.mark.asyncio
async def test_a_chunked_body_is_cut_off_once_it_passes_the_limit() -> None:
    status, body, _ = await call(app(), [b"x" * 600, b"y" * 600, b"z" * 10**6], [])
    assert status == 413 and "1000 bytes" in body["error"]["message"]


@pytest.mark.asyncio
async def test_a_trickled_body_times_out_with_408() -> None:
    status, body, _ = await call(app(timeout_s=0.3), [b"{", b'"a"', b": 1}"], [], delay_s=0.2)
    assert status == 408 and body["error"]["type"] == "RequestTimeoutError"


@pytest.mark.asyncio
async def test_get_requests_pass_through() -> None:
    transport = httpx.ASGITransport(app=app())
    async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
        r = await client.get("/v1/completions")
    assert r.status_code == 200 and r.json() == {"received": 0}
