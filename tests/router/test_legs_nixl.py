"""The leg protocol over vLLM's NixlConnector (`router.legs.nixl`): what P and D are sent, and
the whole split driven through `Flow` against scripted workers that answer as NIXL workers do."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from splitserve.router.legs import DecodeStart, NixlLegs
from splitserve.router.params import plan_legs
from splitserve.router.timings import Timings
from splitserve.router.worker import Worker
from tests.support.scripted import (
    PREFILL_OK,
    chunk,
    identify,
    make_flow,
    sse_reply,
    started,
    workers,
)

INFO = {"connector": "nixl", "kv_host": "127.0.0.1", "kv_port": 5600}
# what P's NixlConnector answers with (vLLM 0.32, pull mode)
P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
            "remote_engine_id": "e-p", "remote_request_id": "cmpl-1", "remote_host": "127.0.0.1",
            "remote_port": 5600, "remote_num_tokens": 3, "transfer_mode": "pull", "tp_size": 1}


def test_p_offers_its_blocks_and_d_gets_ps_answer_back() -> None:
    legs = NixlLegs()
    p, d = Worker("http://127.0.0.1:1", "prefill"), Worker("http://127.0.0.1:2", "decode")
    tr = legs.open(p, d, "rid-1")
    assert tr is not None and tr.prefill_params == {"do_remote_decode": True}
    legs.received(tr, PREFILL_OK | {"kv_transfer_params": P_PARAMS})
    assert tr.decode_params == P_PARAMS
    # D is sent the prompt alone: NIXL moves whole blocks; D generates t1 again
    assert legs.decode_start(tr, [10]) == DecodeStart(P_PARAMS, replayed=1)
    legs.release(tr)
    legs.release(tr)
    assert tr.released
    nothing = legs.open(p, d, "rid-2")
    assert nothing is not None
    legs.received(nothing, PREFILL_OK)  # P kept no blocks: D recomputes after t1
    assert nothing.decode_params is None and legs.decode_start(nothing, [10]) == DecodeStart(None)


async def test_flow_splits_over_nixl() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response(PREFILL_OK | {"kv_transfer_params": P_PARAMS})
        return await sse_reply(req, [chunk("a", 10), chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        for w in flow.registry.workers.values():
            identify(w, INFO)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        assert pre.transfer is not None and isinstance(pre.transfer.via, NixlLegs)
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    (_, p_body), (_, d_body) = seen
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert d_body["prompt"] == [1, 2, 3] and d_body["kv_transfer_params"] == P_PARAMS
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"
    assert joiner.produced == [10, 11, 12]


async def test_a_mixed_pair_moves_no_kv_and_d_recomputes() -> None:
    """P speaks NIXL, D splitserve's connector: P offers nothing, D gets prompt + [t1]."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response(PREFILL_OK)
        return await sse_reply(req, [chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "d1")) as urls, make_flow(urls) as (flow, _):
        for w in flow.registry.workers.values():
            identify(w, INFO if w.pool == "prefill" else {"connector": "splitserve",
                                                          "kv_host": "127.0.0.1", "kv_port": 9})
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        assert pre.transfer is None
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    (_, p_body), (_, d_body) = seen
    assert "kv_transfer_params" not in p_body and "kv_transfer_params" not in d_body
    assert d_body["prompt"] == [1, 2, 3, 10]
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"
    assert joiner.produced == [10, 11, 12]


async def test_a_failed_p_is_retried_under_fresh_params_and_d_reads_the_retrys_blocks() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    p2_params = P_PARAMS | {"remote_engine_id": "e-p2", "remote_block_ids": [[7, 8]],
                            "remote_port": 5601}

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if name == "p2":
            return web.json_response(PREFILL_OK | {"kv_transfer_params": p2_params})
        return await sse_reply(req, [chunk("a", 10), chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "p2", "d1")) as urls, make_flow(urls) as (flow, _):
        for w in flow.registry.workers.values():
            identify(w, INFO)
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
    assert [n for n, _ in seen] == ["p1", "p2", "d1"]
    (_, p1_body), (_, p2_body), (_, d_body) = seen
    assert p1_body["kv_transfer_params"] == p2_body["kv_transfer_params"] == {
        "do_remote_decode": True}
    assert d_body["kv_transfer_params"] == p2_params and d_body["prompt"] == [1, 2, 3]
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"
    assert joiner.produced == [10, 11, 12] and t.retries == 1
    assert all(w.inflight == 0 for w in flow.registry.workers.values())
