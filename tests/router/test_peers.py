"""The peer routers' share of the load (`router.peers`): the message each router serves, the sums
a router keeps per worker, when a peer's share stops counting, and what the policies see."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from splitserve.common.wire import WireError
from splitserve.router.config import RouterConfig
from splitserve.router.peers import (
    LOAD_ROUTE,
    STALE_INTERVALS,
    LegLoad,
    PeerRead,
    Peers,
    RouterLoad,
    shares,
)
from splitserve.router.registry import Registry
from splitserve.router.worker import PeerShare
from splitserve.worker.launch import free_port

P, D = "http://p:1", "http://d:1"


def registry() -> Registry:
    return Registry(RouterConfig(prefill=(P,), decode=(D,)))


def test_the_router_load_message_round_trips_and_refuses_bad_counts() -> None:
    reg = registry()
    p = reg.find(P)[0]
    p.acquire(300)
    p.peers = PeerShare(5, 900)  # a peer's share is never served on: only this router's legs
    load = RouterLoad.of(reg.all())
    assert RouterLoad.from_json(load.to_json()) == load
    assert LegLoad(P, "prefill", 1, 300) in load.workers
    for bad in ({}, {"workers": {}}, {"workers": [{"url": P}]},
                {"workers": [{"url": P, "pool": "prefill", "inflight": -1}]},
                {"workers": [{"url": P, "pool": "prefill", "inflight": True}]}):
        with pytest.raises(WireError):
            RouterLoad.from_json(bad)


def test_shares_sum_over_peers_by_pool_and_url() -> None:
    a = RouterLoad((LegLoad(P, "prefill", 2, 100), LegLoad(D, "decode", 1, 0)))
    b = RouterLoad((LegLoad(P + "/", "prefill", 1, 50),))
    assert shares([a, b]) == {("prefill", P): PeerShare(3, 150), ("decode", D): PeerShare(1, 0)}


def test_a_policy_sees_its_own_legs_plus_the_peers_and_drains_count_its_own() -> None:
    reg = registry()
    p = reg.find(P)[0]
    p.acquire(100)
    p.peers = PeerShare(2, 400)
    assert (p.inflight, p.inflight_prefill_tokens) == (3, 500)
    assert p.describe()["inflight"] == 1 and p.describe()["peer_inflight"] == 2
    p.release(100)
    assert p.drained.is_set()  # the peers' legs are theirs to drain


def test_a_peer_share_counts_while_fresh_and_is_dropped_when_stale_or_unreachable() -> None:
    async def run() -> None:
        reg = registry()
        async with aiohttp.ClientSession() as session:
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            peers = Peers(reg, session, [dead, "http://r2:1/"], interval_s=0.5, timeout_s=1.0)
            assert peers.urls == (dead, "http://r2:1")
            load = RouterLoad((LegLoad(D, "decode", 4, 0),))
            now = time.monotonic()
            peers.reads[dead] = PeerRead(load, now)
            peers.reads["http://r2:1"] = PeerRead(load, now - STALE_INTERVALS * 0.5 - 0.1)
            peers.apply(now)
            d = reg.find(D)[0]
            assert d.peers == PeerShare(4, 0)  # the stale one does not count
            await peers._read(dead)  # connection refused: its share goes at once
            peers.apply(time.monotonic())
            assert d.peers == PeerShare() and peers.errors[dead]
            assert [p["counted"] for p in peers.describe()] == [False, False]
            peers.set(["http://r3:1"])
            assert peers.urls == ("http://r3:1",) and not peers.reads
            with pytest.raises(ValueError, match="http"):
                peers.set(["r4:1"])

    asyncio.run(run())


def test_a_peer_removed_while_its_read_is_in_flight_does_not_count_again() -> None:
    """The peer list changes (`PUT /admin/peers`) while a read of a peer now gone is still
    on its way: its answer, or its failure, is dropped; the share stays out. An answer the
    reader cannot parse at all is that peer's error, not the end of the reading."""
    async def run() -> None:
        release = asyncio.Event()
        broken: list[bool] = []

        async def load(_req: web.Request) -> web.Response:
            await release.wait()
            if broken:
                return web.Response(body=b"[" * 200_000, content_type="application/json")
            return web.json_response(RouterLoad((LegLoad(D, "decode", 7, 0),)).to_json())

        app = web.Application()
        app.router.add_get(LOAD_ROUTE, load)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        reg = registry()
        try:
            async with aiohttp.ClientSession() as session:
                peer = f"http://127.0.0.1:{port}"
                peers = Peers(reg, session, [peer], interval_s=2.0, timeout_s=5.0)
                reading = asyncio.create_task(peers.read_all())
                await asyncio.sleep(0.2)
                peers.set([])
                release.set()
                await reading
                assert not peers.reads and not peers.errors
                assert reg.find(D)[0].peers == PeerShare()
                peers.set([peer])
                broken.append(True)
                await peers.read_all()
                assert "RecursionError" in peers.errors[peer] and not peers.reads
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_peer_urls_are_checked_in_the_config() -> None:
    with pytest.raises(ValueError, match="peer router URL"):
        RouterConfig(prefill=(P,), decode=(D,), peers=("localhost:8001",))
