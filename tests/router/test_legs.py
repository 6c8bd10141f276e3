"""The leg protocol (`router.legs`): splitserve's connector as its implementation, how a pair's
advertised connector selects it, and the contract's replay rule driven through `Flow` by a
second connector scripted here (the swap point: `Flow` names no connector)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from splitserve.common.vocab import Connector, TransferStatus
from splitserve.common.wire import SideRecord
from splitserve.router.config import RouterConfig
from splitserve.router.http import new_session
from splitserve.router.legs import (
    DecodeStart,
    LegProtocol,
    LegProtocols,
    SplitserveLegs,
    Transfer,
    drop_replayed,
    leg_protocols,
)
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

INFO = {"kv_host": "127.0.0.1", "kv_port": 5, "engine_id": "e", "transport": "tcp"}


def pair(p_info: dict[str, Any] | None, d_info: dict[str, Any] | None) -> tuple[Worker, Worker]:
    p, d = Worker("http://127.0.0.1:1", "prefill"), Worker("http://127.0.0.1:2", "decode")
    identify(p, p_info)
    identify(d, d_info)
    return p, d


class Replaying(LegProtocol):
    """A connector whose D is sent the prompt alone and generates t1 again (registered here in
    NIXL's place: a connector's name is one of `Connector`)."""

    connector = Connector.NIXL

    def __init__(self) -> None:
        self.released: list[str] = []

    def open(self, p: Worker, d: Worker, transfer_id: str, d_cached: int = 0
             ) -> Transfer | None:
        return Transfer(self, transfer_id, p, d, {"do_remote_decode": True, "lease": transfer_id})

    def received(self, transfer: Transfer, answer: dict[str, Any]) -> None:
        transfer.decode_params = {"blocks": answer["kv_transfer_params"]["blocks"]}

    def decode_start(self, transfer: Transfer, produced: list[int]) -> DecodeStart:
        return DecodeStart(transfer.decode_params, replayed=1)

    def release(self, transfer: Transfer) -> None:
        if not transfer.released:
            transfer.released = True
            self.released.append(transfer.transfer_id)


def replaying_protocols(session: Any) -> LegProtocols:
    return LegProtocols(SplitserveLegs(session, None), Replaying())


async def test_the_advertised_connector_selects_the_protocol() -> None:
    cfg = RouterConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",))
    session = new_session(cfg, None)
    try:
        protocols = LegProtocols(SplitserveLegs(session, None), Replaying())
        ours = protocols.by_connector["splitserve"]
        assert protocols.for_pair(*pair(INFO, INFO)) is ours  # no `connector` key: ours
        assert protocols.for_pair(*pair(INFO, INFO | {"connector": "splitserve"})) is ours
        both = INFO | {"connector": "nixl"}
        assert protocols.for_pair(*pair(both, both)) is protocols.by_connector["nixl"]
        assert protocols.for_pair(*pair(INFO, both)) is None  # P and D speak different ones
        only_ours = LegProtocols(SplitserveLegs(session, None))
        assert only_ours.for_pair(*pair(both, both)) is None  # no implementation here
        assert protocols.for_pair(*pair({}, INFO)) is None  # plain vLLM P
        assert protocols.for_pair(*pair(INFO, None)) is None  # D's info not read yet
        p, d = pair({}, None)
        assert protocols.for_worker(p) is None and protocols.for_worker(d) is None
        assert set(leg_protocols(session, None).by_connector) == {"splitserve", "nixl", "mooncake"}
    finally:
        await session.close()


async def test_splitserve_legs_name_the_transfer_and_d_endpoint() -> None:
    cfg = RouterConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",))
    session = new_session(cfg, None)
    try:
        p, d = pair(INFO, INFO)
        tr = SplitserveLegs(session, None).open(p, d, "rid-1")
        assert tr is not None and tr.prefill is p and tr.decode is d
        assert tr.prefill_params == {"do_remote_decode": True, "transfer_id": "rid-1",
                                     "remote_host": "127.0.0.1", "remote_port": 5,
                                     "remote_engine_id": "e", "transport": "tcp"}
        shm = SplitserveLegs(session, None, "shm").open(p, d, "rid-2")
        assert shm is not None and shm.prefill_params["transport"] == "shm"
        # D is expected to hold the prompt's first 256 tokens: P pushes only the rest
        delta = SplitserveLegs(session, None).open(p, d, "rid-3", d_cached=256)
        assert delta is not None and delta.prefill_params == {
            **tr.prefill_params, "transfer_id": "rid-3", "skip_tokens": 256}
        assert SplitserveLegs(session, None).open(*pair(INFO, {"engine_id": "e"}), "t") is None
        tr.via.received(tr, PREFILL_OK)
        assert tr.decode_params == {"do_remote_prefill": True, "transfer_id": "rid-1"}
        assert tr.via.decode_start(tr, [10]) == DecodeStart(tr.decode_params, 0)
        tr.via.release(tr)  # without the deployment token: marked, nothing sent
        assert tr.released
        assert await tr.via.record(tr, d.url) is None
    finally:
        await session.close()


async def test_splitserve_release_is_one_delete_and_record_reads_d() -> None:
    seen: list[tuple[str, str]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((req.method, req.path))
        if req.method == "GET" and req.path.endswith("/known"):
            return web.json_response({"transfer_id": "known", "recv": {
                "transfer_id": "known", "side": "recv", "status": "complete", "bytes": 7}})
        if req.method == "GET":
            return web.json_response({"error": {"message": "unknown"}}, status=404)
        return web.json_response({"discarded": True})

    async with workers(handler, ("p1", "d1")) as urls:
        cfg = RouterConfig(prefill=(urls["p1"],), decode=(urls["d1"],))
        session = new_session(cfg, "tok")
        try:
            legs = SplitserveLegs(session, "tok")
            p, d = Worker(urls["p1"], "prefill"), Worker(urls["d1"], "decode")
            identify(d, INFO)
            tr = legs.open(p, d, "known")
            assert tr is not None
            record = await legs.record(tr, d.url)
            assert record == SideRecord("known", "recv", TransferStatus.COMPLETE, bytes=7)
            assert not legs.record_final(record)
            assert legs.record_final(replace(record, status=TransferStatus.LOADED))
            legs.release(tr)
            legs.release(tr)  # idempotent
            for _ in range(100):
                if ("DELETE", "/splitserve/transfers/known") in seen:
                    break
                await asyncio.sleep(0.01)
            other = legs.open(p, d, "lost")
            assert other is not None and await legs.record(other, d.url) is None  # 404
        finally:
            await session.close()
    assert seen.count(("DELETE", "/splitserve/transfers/known")) == 1
    assert ("DELETE", "/splitserve/transfers/known") in seen


def test_drop_replayed_checks_what_the_client_has() -> None:
    assert drop_replayed([10, 11], [10], 1) == [11]
    assert drop_replayed([9], [9, 10], 2) == []  # one of two replayed tokens, in order
    assert drop_replayed([10], [9, 10], 1) == []
    with pytest.raises(ValueError):
        drop_replayed([12], [10], 1)


async def test_flow_drives_another_connector_through_the_protocol() -> None:
    """D is sent the prompt alone with the P answer's params; the t1 D generates again is checked
    and dropped, so the client gets every token once; the transfer is claimed, not released."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response(PREFILL_OK | {"kv_transfer_params": {"blocks": [3, 4]}})
        return await sse_reply(req, [chunk("a", 10), chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "d1")) as urls, make_flow(
            urls, protocols=replaying_protocols) as (flow, _):
        for w in flow.registry.workers.values():
            identify(w, INFO | {"connector": "nixl"})
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True,
                          "min_tokens": 3}, "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        assert pre.transfer is not None and pre.transfer.via is flow.protocols.by_connector[
            "nixl"]
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    (_, p_body), (_, d_body) = seen
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True,
                                            "lease": pre.transfer.transfer_id}
    assert d_body["prompt"] == [1, 2, 3] and d_body["max_tokens"] == 3
    assert d_body["min_tokens"] == 3 and d_body["kv_transfer_params"] == {"blocks": [3, 4]}
    assert [c["choices"][0]["token_ids"] for c in out] == [None, None]  # no return_token_ids
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"
    assert joiner.produced == [10, 11, 12] and joiner.finish_reason == "length"
    assert flow.protocols.by_connector["nixl"].released == []  # type: ignore[attr-defined]


async def test_a_wrong_replay_fails_the_leg_and_resumes_by_recomputation() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        seen.append((name, await req.json()))
        if name == "p1":
            return web.json_response(PREFILL_OK | {"kv_transfer_params": {"blocks": [3]}})
        if name == "d1":  # D's t1 differs from P's: its KV is not the prompt's
            return await sse_reply(req, [chunk("z", 99), chunk("b", 11, "length")])
        return await sse_reply(req, [chunk("b", 11), chunk("c", 12, "length")])

    async with workers(handler, ("p1", "d1", "d2")) as urls, make_flow(
            urls, protocols=replaying_protocols) as (flow, metrics):
        for w in flow.registry.workers.values():
            identify(w, INFO | {"connector": "nixl"})
        legs = plan_legs({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True},
                         "completion", "x")
        pre = await flow.prefill(legs, "rid", t := Timings())
        joiner = started(legs, pre)
        out = [c async for c in flow.decode(legs, "rid", pre, joiner, t)]
        assert all(w.inflight == 0 for w in flow.registry.workers.values())
    assert "".join(c["choices"][0]["text"] for c in out) == "bc"
    assert joiner.produced == [10, 11, 12]
    (_, resumed), = [(n, b) for n, b in seen if n == "d2"]
    assert resumed["prompt"] == [1, 2, 3, 10] and "kv_transfer_params" not in resumed
    assert metrics.failures.labels("decode", "replay_mismatch")._value.get() == 1
