"""The two legs against scripted workers (httpx.MockTransport): P retried on another P with a
fresh transfer id, D resumed on another D with prompt + every token already produced, 4xx passed
through untouched. Real workers are in test_e2e.py; these pin the failure paths down exactly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from splitserve.router.config import RouterConfig
from splitserve.router.flow import Flow, Timings, UpstreamError
from splitserve.router.formats import Joiner
from splitserve.router.health import Registry
from splitserve.router.metrics import RouterMetrics
from splitserve.router.params import plan_legs
from splitserve.router.policy import Picker

P1, P2, D1, D2 = (f"http://{n}:1" for n in ("p1", "p2", "d1", "d2"))


def chunk(text: str, tok: int, finish: str | None = None) -> bytes:
    c = {"choices": [{"index": 0, "text": text, "token_ids": [tok], "finish_reason": finish,
                      "stop_reason": None}]}
    return f"data: {json.dumps(c)}\n\n".encode()


class CutStream(httpx.AsyncByteStream):
    """Yields some SSE chunks, then fails like a worker that died mid-stream."""

    def __init__(self, parts: list[bytes], cut: bool) -> None:
        self.parts, self.cut = parts, cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for p in self.parts:
            yield p
        if self.cut:
            raise httpx.ReadError("connection reset by peer")
        yield b"data: [DONE]\n\n"


def make_flow(handler: Callable[[httpx.Request], httpx.Response], token: str | None = None
              ) -> tuple[Flow, RouterMetrics]:
    cfg = RouterConfig(prefill=(P1, P2), decode=(D1, D2), retry_backoff_s=0.0)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    reg = Registry(cfg, client, token=token)
    for w in reg.workers.values():
        w.healthy = True
    metrics = RouterMetrics()
    return Flow(cfg, reg, Picker("load", "load"), metrics, client, "m", 0,
                2048), metrics


PREFILL_OK = {"choices": [{"text": "a", "token_ids": [10], "prompt_token_ids": [1, 2, 3],
                           "finish_reason": "length", "stop_reason": None}],
              "system_fingerprint": "fp"}


async def test_prefill_retries_elsewhere_and_decode_resumes_without_loss() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        host = f"http://{req.url.host}:1"
        body = json.loads(req.content)
        seen.append((host, body))
        if host == P1:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        if host == P2:
            return httpx.Response(200, json=PREFILL_OK)
        if host == D1:
            return httpx.Response(200, stream=CutStream([chunk("b", 11), chunk("c", 12)], True))
        return httpx.Response(200, stream=CutStream(
            [chunk("d", 13), chunk("e", 14, "length")], False))

    flow, metrics = make_flow(handler)
    legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 5, "stream": True},
                     "completion", "x")
    t = Timings()
    pre = await flow.prefill(legs, "rid", t)
    assert [h for h, _ in seen] == [P1, P2] and pre.t1_ids == [10] and pre.finish_reason is None
    joiner = Joiner(legs, "rid", "m")
    joiner.start(pre.prompt_ids, pre.fingerprint)
    joiner.tokens(pre.t1_text, pre.t1_ids, None, None)
    out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    assert "".join(c["choices"][0]["text"] for c in out) == "bcde"
    assert joiner.produced == [10, 11, 12, 13, 14] and joiner.finish_reason == "length"
    (_, resumed), = [(h, b) for h, b in seen if h == D2]
    assert resumed["prompt"] == [1, 2, 3, 10, 11, 12] and resumed["max_tokens"] == 2
    assert "kv_transfer_params" not in resumed  # recomputed on the new D: no foreign KV read
    assert t.retries == 2
    assert all(w.inflight == 0 for w in flow.registry.workers.values())  # nothing left open
    assert metrics.failures.labels("prefill", "http_503")._value.get() == 1
    assert metrics.failures.labels("decode", "ReadError")._value.get() == 1


async def test_client_errors_are_the_answer_not_retried() -> None:
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.host)
        return httpx.Response(400, json={"error": {"message": "max_tokens too big",
                                                   "type": "BadRequestError",
                                                   "param": "max_tokens", "code": 400}})

    flow, _ = make_flow(handler)
    legs = plan_legs({"model": "m", "prompt": "x"}, "completion", "x")
    with pytest.raises(UpstreamError) as err:
        await flow.prefill(legs, "rid", Timings())
    assert err.value.status == 400 and err.value.body["error"]["param"] == "max_tokens"
    assert len(calls) == 1


async def test_request_ending_at_t1_needs_no_decode_and_moves_no_kv() -> None:
    bodies: list[dict[str, Any]] = []
    discarded: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "DELETE":  # D told that no decode leg will claim the staged KV
            assert req.headers["authorization"] == "Bearer tok"
            discarded.append(req.url.path.rsplit("/", 1)[1])
            return httpx.Response(200, json={"discarded": True})
        bodies.append(json.loads(req.content))
        return httpx.Response(200, json=PREFILL_OK)

    flow, _ = make_flow(handler, token="tok")
    for w in flow.registry.workers.values():
        w.info = {"kv_host": "127.0.0.1", "kv_port": 5, "engine_id": "e", "transport": "tcp"}
    one = plan_legs({"model": "m", "prompt": "x", "max_tokens": 1}, "completion", "x")
    pre = await flow.prefill(one, "rid", Timings())
    assert pre.decode is None and pre.finish_reason == "length" and not pre.reserved
    assert all(w.inflight == 0 for w in flow.registry.workers.values())
    assert "kv_transfer_params" not in bodies[-1]
    more = plan_legs({"model": "m", "prompt": "x", "max_tokens": 4}, "completion", "x")
    pre = await flow.prefill(more, "rid", Timings())
    kv = bodies[-1]["kv_transfer_params"]
    assert kv["do_remote_decode"] and kv["remote_port"] == 5 and kv["transport"] == "tcp"
    assert pre.kv == {"do_remote_prefill": True, "transfer_id": kv["transfer_id"]}
    # the chosen D is held from the moment it is picked, so a burst spreads over both Ds
    assert pre.reserved and pre.decode is not None and pre.decode.inflight == 1
    second = await flow.prefill(more, "rid2", Timings())
    assert second.decode is not None and second.decode is not pre.decode
    flow.release(pre)
    flow.release(second)
    flow.release(second)  # idempotent
    assert all(w.inflight == 0 for w in flow.registry.workers.values())
    for _ in range(5):  # let the background DELETEs run
        await asyncio.sleep(0)
    assert sorted(discarded) == sorted([str(pre.kv["transfer_id"]),
                                        str(second.kv["transfer_id"])])


async def test_every_prefill_failure_ends_in_one_explicit_error() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    flow, _ = make_flow(handler)
    legs = plan_legs({"model": "m", "prompt": "x"}, "completion", "x")
    with pytest.raises(UpstreamError) as err:
        await flow.prefill(legs, "rid", Timings())
    assert err.value.status == 502 and "prefill failed" in err.value.body["error"]["message"]
