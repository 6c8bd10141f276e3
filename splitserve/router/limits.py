"""Request bodies, bounded: `BodyLimit` reads each request body itself, within a byte limit and a
time limit, before the app sees it.

Invariants:
- No handler ever holds more than `max_bytes` of one request body: a declared Content-Length
  above it is refused before a byte is read (413), a chunked body is cut off the moment it
  passes it (413).
- A client that trickles its body (slow loris) is answered 408 after `timeout_s`, so it cannot
  hold an admission slot or a connection open indefinitely.
- The app receives the buffered body as one message, then the connection's own messages (so
  it still sees `http.disconnect`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.router.formats import error_body, request_id

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(413, f"request body of {declared} bytes is over the limit of "
                                    f"{self.max_bytes} bytes", scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task per request
                body = await self._read(receive)
        except BodyTooLarge:
            await self._refuse(413, f"request body is over the limit of {self.max_bytes} "
                                    "bytes", scope, receive, send)
            return
        except TimeoutError:
            await self._refuse(408, f"request body not received within {self.timeout_s:g} s",
                               scope, receive, send)
            return
        if body is None:  # the client left while sending
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyTooLarge()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    async def _refuse(status: int, message: str, scope: Scope, receive: Receive,
                      send: Send) -> None:
        kind = "RequestTooLargeError" if status == 413 else "RequestTimeoutError"
        headers = {"Connection": "close",
                   "X-Request-Id": request_id(_header(scope, b"x-request-id"))}
        await JSONResponse(error_body(message, kind, None, status), status,
                           headers=headers)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text: Any = value.decode("latin-1")
            return str(text)
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
