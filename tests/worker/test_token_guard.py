"""`TokenGuard`, the worker's deployment-token check, in front of a small ASGI app standing in
for vLLM's: HTTP without the token is a 401 with an OpenAI-style body, a WebSocket without it
is closed with 1008 before the app sees it, and both pass with it."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from splitserve.worker.plugin import TokenGuard

GOOD = {"Authorization": "Bearer tok"}


async def hello(_: object) -> PlainTextResponse:
    return PlainTextResponse("served")


async def realtime(ws: WebSocket) -> None:  # as vLLM's /v1/realtime
    await ws.accept()
    await ws.send_text("served")
    await ws.close()


def client() -> TestClient:
    app = Starlette(routes=[Route("/v1/models", hello), WebSocketRoute("/v1/realtime", realtime)])
    return TestClient(TokenGuard(app, "tok"))


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}])
def test_a_request_without_the_token_never_reaches_the_engine(headers: dict[str, str]) -> None:
    c = client()
    r = c.get("/v1/models", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"] == {"message": "this worker requires the deployment token",
                                 "type": "authentication_error", "param": None, "code": 401}
    with pytest.raises(WebSocketDisconnect) as closed, c.websocket_connect(
            "/v1/realtime", headers=headers) as ws:
        ws.receive_text()
    assert closed.value.code == 1008


def test_the_token_lets_http_and_websockets_through() -> None:
    c = client()
    assert c.get("/v1/models", headers=GOOD).text == "served"
    with c.websocket_connect("/v1/realtime", headers=GOOD) as ws:
        assert ws.receive_text() == "served"
