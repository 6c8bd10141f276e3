"""The chaos client's classification: every way a request can end, by hand."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.bench.chaos import Outcome, classify, stream_one, summarize

REF = [5, 6, 7]


def ok(**kw: object) -> Outcome:
    base = {"rid": "r", "status": 200, "tokens": list(REF), "finish_reason": "length",
            "done": True}
    return Outcome(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("outcome, kind", [
    (ok(), "complete"),
    (ok(tokens=[5, 6, 8]), "wrong"),  # a 200 with bad tokens
    (ok(tokens=[5, 6]), "wrong"),  # silently truncated but "finished"
    (ok(done=False), "lost"),  # no [DONE]
    (ok(finish_reason=None), "lost"),  # no finish reason
    (ok(done=False, transport_error="RemoteProtocolError: cut"), "lost"),
    (ok(tokens=[5], finish_reason=None, error={"message": "decode failed", "type": "x"}),
     "error"),  # an SSE error event, then [DONE]
    (ok(tokens=[5], finish_reason=None, done=False, error={"message": "m", "type": "x"}),
     "lost"),  # an error event without [DONE]: the stream still broke
    (Outcome("r", status=429, error={"message": "busy", "type": "RateLimitError"}), "error"),
    (Outcome("r", status=502), "lost"),  # a 5xx without an error body is not explicit
    (ok(tokens=[5], disconnected=True, done=False, finish_reason=None), "cancelled"),
])
def test_classify(outcome: Outcome, kind: str) -> None:
    assert classify(outcome, REF) == kind


def test_summarize_counts_every_kind() -> None:
    outs = [ok(rid="a"), ok(rid="b", tokens=[1]), Outcome("c", status=503)]
    summary = summarize(outs, {"a": REF, "b": REF, "c": REF})
    assert (summary["sent"], summary["complete"], summary["wrong"], summary["lost"],
            summary["error"]) == (3, 1, 1, 1, 0)
    assert {b["rid"] for b in summary["bad"]} == {"b", "c"}


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def completions(request: Request) -> Response:
    rid = request.headers["x-request-id"]
    if rid == "busy":
        return JSONResponse({"error": {"message": "busy", "type": "RateLimitError"}}, 429)
    if rid == "broken":
        body = sse({"choices": [{"token_ids": [5], "finish_reason": None}]},
                   {"error": {"message": "decode failed", "type": "UpstreamError"}})
    else:
        body = sse({"choices": [{"token_ids": [5, 6], "finish_reason": None}]},
                   {"choices": [{"token_ids": [7], "finish_reason": "length"}]})
    return StreamingResponse(iter([body]), media_type="text/event-stream")


@pytest.mark.asyncio
async def test_stream_one_reads_tokens_errors_and_done() -> None:
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://x") as client:
        good = await stream_one(client, "http://x", {}, "good")
        broken = await stream_one(client, "http://x", {}, "broken")
        busy = await stream_one(client, "http://x", {}, "busy")
        gone = await stream_one(client, "http://x", {}, "gone", disconnect_after=2)
    assert (classify(good, REF), good.tokens) == ("complete", REF)
    assert classify(broken, REF) == "error" and broken.tokens == [5]
    assert classify(busy, REF) == "error" and busy.status == 429
    assert classify(gone, REF) == "cancelled"
