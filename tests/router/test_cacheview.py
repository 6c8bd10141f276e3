"""The router's cache view (`router.cacheview`) against scripted cache reports: following,
410 and gaps (resnapshot), restarts and new epochs (forget), removed workers, lost streams
(routed by load, and a metric says so), workers that do not report, and a router restarted
mid-stream (the same index as one that never stopped)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from splitserve.common.vocab import Pool
from splitserve.common.wire import WorkerInfo
from splitserve.kvindex.keys import prefix_keys
from splitserve.router.cacheview import CacheView, ViewState
from splitserve.router.config import RouterConfig
from splitserve.router.http import new_session
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import Picker
from splitserve.router.registry import Registry
from splitserve.routing import RouteRequest
from tests.support.scripted import FAST_FOLLOW as FAST
from tests.support.scripted import ScriptedCache, until, workers

PROMPT = list(range(1000, 1030))  # 7 blocks of 4 tokens and 2 more


@dataclass
class Setup:
    caches: dict[str, ScriptedCache]
    urls: dict[str, str]
    registry: Registry
    metrics: RouterMetrics
    view: CacheView

    def new_view(self) -> CacheView:
        """Another router's view over the same registry (a router started now)."""
        return CacheView(self.registry, self.view.session, RouterMetrics(), FAST)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def followed(names: tuple[str, ...] = ("p0", "d0")) -> AsyncIterator[Setup]:
    caches = {n: ScriptedCache() for n in names}

    async def handler(name: str, req: web.Request) -> web.StreamResponse:
        answer = await caches[name].handle(req)
        return answer if answer is not None else web.Response(status=404)

    async with workers(handler, names) as urls:
        by_role = {r: tuple(u for n, u in urls.items() if n[0] == r[0])
                   for r in ("prefill", "decode")}
        cfg = RouterConfig(prefill=by_role["prefill"], decode=by_role["decode"])
        session = new_session(cfg, "tok")
        reg = Registry(cfg)
        for w in reg.all():
            w.health.healthy = True
        metrics = RouterMetrics()
        view = CacheView(reg, session, metrics, FAST)
        try:
            yield Setup(caches, urls, reg, metrics, view)
        finally:
            await view.close()
            await session.close()


def synced(view: CacheView, *urls: str) -> Callable[[], bool]:
    return lambda: all(view.synced(u) for u in urls)


async def test_follows_every_worker_from_snapshot_through_changes() -> None:
    async with followed() as s:
        p, d = s.urls["p0"], s.urls["d0"]
        s.caches["p0"].store(PROMPT[:12])  # before the router reads: in the snapshot
        await until(synced(s.view, p, d))
        assert s.view.predict(PROMPT, [p, d]) == {p: 12, d: 0}
        s.caches["d0"].store(PROMPT)  # after: through the long poll
        await until(lambda: s.view.predict(PROMPT, [p, d]) == {p: 12, d: 28})
        s.caches["p0"].change(removed=prefix_keys(PROMPT, 4)[1:2])
        await until(lambda: s.view.predict(PROMPT, [p, d]) == {p: 4, d: 28})
        assert s.view.index.keys_of(d) == s.caches["d0"].keys
        described = s.view.describe(d)
        assert described is not None and described["synced"] and described["tokens"] == 28
        assert described["blocks"] == 7 and described["synced_after_s"] is not None
        assert s.metrics.registry.get_sample_value("splitserve_router_kv_event_lag_seconds_count"
                                                   ) == 2
        assert s.view.all_synced_after_s is not None and s.view.all_synced_after_s < 2


async def test_410_and_a_gap_take_a_new_snapshot() -> None:
    async with followed() as s:
        p, cache = s.urls["p0"], s.caches["p0"]
        await until(synced(s.view, p))
        cache.gone = True  # the worker no longer has the changes after the router's seq
        cache.store(PROMPT[:8])
        await until(lambda: s.sample("splitserve_router_kv_resyncs_total", url=p,
                                     reason="gone") == 1)
        await until(lambda: s.view.synced(p) and s.view.index.keys_of(p) == cache.keys)
        snapshots = sum(a.startswith("/splitserve/kv/snapshot") for a in cache.asked)
        assert snapshots == 2
        cache.skip = True  # the next change's seq jumps: a change was lost
        cache.store(PROMPT)
        await until(lambda: s.sample("splitserve_router_kv_resyncs_total", url=p,
                                     reason="gap") == 1)
        await until(lambda: s.view.synced(p) and s.view.index.keys_of(p) == cache.keys)
        assert s.view.predict(PROMPT, [p]) == {p: 28}


async def test_resyncs_in_quick_succession_back_off() -> None:
    """Two engines' reports behind one URL (a snapshot of one epoch, a 410 from the other, and
    again): the follower takes snapshots less and less often, not in a tight loop (each is
    the worker's whole cache)."""
    async with followed() as s:
        p, cache = s.urls["p0"], s.caches["p0"]
        cache.store(PROMPT)
        await until(synced(s.view, p))
        cache.two_lives = cache.gone = True  # from the next read on
        cache.store(PROMPT[:8])  # ends the long poll
        await asyncio.sleep(1.0)
        snapshots = sum(a.startswith("/splitserve/kv/snapshot") for a in cache.asked)
        # at most one a `backoff_max_s` (0.1 s here) once backed off: about ten; a tight
        # loop takes hundreds
        assert 3 < snapshots < 25, snapshots
        cache.two_lives = False
        await until(lambda: s.view.synced(p) and s.view.predict(PROMPT, [p]) == {p: 28})


async def test_a_new_epoch_or_a_restart_forgets_the_worker() -> None:
    async with followed(("p0", "d0")) as s:
        p, cache = s.urls["p0"], s.caches["p0"]
        cache.store(PROMPT)
        await until(lambda: s.view.predict(PROMPT, [p]) == {p: 28})
        cache.restart("e2")  # the relay started over: a new epoch, nothing cached: 410
        await until(lambda: s.sample("splitserve_router_kv_resyncs_total", url=p,
                                     reason="gone") == 1)
        await until(lambda: s.view.synced(p) and s.view.predict(PROMPT, [p]) == {p: 0})
        cache.store(PROMPT)
        await until(lambda: s.view.predict(PROMPT, [p]) == {p: 28})
        cache.check_epoch = False  # a worker that answers with its new epoch instead
        cache.restart("e2b")
        cache.store(PROMPT[:12])
        await until(lambda: s.sample("splitserve_router_kv_resyncs_total", url=p,
                                     reason="epoch") == 1)
        await until(lambda: s.view.synced(p) and s.view.predict(PROMPT, [p]) == {p: 12})
        cache.check_epoch = True
        # the registry says the worker restarted (a new engine_id): forgotten, read again
        cache.change(cleared=True, stored=prefix_keys(PROMPT[:8], 4))
        await until(lambda: s.view.predict(PROMPT, [p]) == {p: 8})
        cache.restart("e3")
        cache.store(PROMPT[:4])
        (worker,) = s.registry.find(p)
        reports = {"role": "prefill", "kv_events": True, "block_size": 4}
        s.registry.identified(worker, WorkerInfo.from_json(reports | {"engine_id": "a"}))
        s.registry.identified(worker, WorkerInfo.from_json(reports | {"engine_id": "b"}))
        assert s.sample("splitserve_router_kv_resyncs_total", url=p, reason="restart") == 1
        await until(lambda: s.view.synced(p) and s.view.predict(PROMPT, [p]) == {p: 4})


async def test_a_removed_worker_is_forgotten() -> None:
    async with followed(("p0", "d0")) as s:
        d = s.urls["d0"]
        s.caches["d0"].store(PROMPT)
        await until(lambda: s.view.predict(PROMPT, [d]) == {d: 28})
        (worker,) = s.registry.find(d)
        await s.registry.remove(worker)
        assert d not in s.view.followers and d not in s.view.index
        assert s.view.predict(PROMPT, [d]) is None and len(s.view.index) == 0
        asked = len(s.caches["d0"].asked)
        await asyncio.sleep(0.3)
        assert len(s.caches["d0"].asked) <= asked + 1  # its follower stopped


async def test_a_lost_stream_routes_by_load_until_rebuilt() -> None:
    async with followed(("p0", "p1", "d0")) as s:
        p0, p1, d = s.urls["p0"], s.urls["p1"], s.urls["d0"]
        s.caches["p0"].store(PROMPT)
        await until(lambda: s.view.predict(PROMPT, [p0, p1]) == {p0: 28, p1: 0})
        picker = Picker("cache", "cache")
        ps = s.registry.routable(Pool.PREFILL)
        worker = {w.url: w for w in ps}

        def pick() -> str:
            cached = s.view.predict(PROMPT, [p0, p1, d])
            return picker.prefill(ps, RouteRequest.of_ids(PROMPT, 0, cached)).url

        worker[p0].acquire(20)  # p0 has 20 tokens queued, p1 none: p0's 28 cached still win
        assert pick() == p0
        gauge = {"role": "prefill", "url": p0, "node": ""}
        s.metrics.watch_cache(s.registry.all, s.view.describe, lambda: (0, 0))
        assert s.sample("splitserve_router_worker_kv_synced", **gauge) == 1
        s.caches["p0"].down = True  # the stream is cut, and so is every retry
        await until(lambda: s.view.followers[p0].state == ViewState.LOST)
        assert s.view.predict(PROMPT, [p0, p1]) == {p1: 0}
        assert pick() == p1  # by load: p0's cache is unknown
        assert s.sample("splitserve_router_worker_kv_synced", **gauge) == 0
        assert s.sample("splitserve_router_kv_resyncs_total", url=p0, reason="lost") == 1
        s.caches["p0"].down = False
        await until(lambda: s.view.synced(p0))
        assert pick() == p0 and s.sample("splitserve_router_worker_kv_synced", **gauge) == 1


async def test_a_report_that_breaks_the_reader_loses_the_view_and_the_follower_lives_on(
) -> None:
    """An events answer the reader cannot parse at all (JSON nested past Python's recursion
    limit: a RecursionError, no ValueError) loses the worker's view like a cut stream, never
    leaving it frozen: routed by load, then rebuilt by the same follower; closing is clean."""
    async with followed(("p0", "d0")) as s:
        p = s.urls["p0"]
        s.caches["p0"].store(PROMPT)
        await until(lambda: s.view.predict(PROMPT, [p]) == {p: 28})
        follower = s.view.followers[p]
        task = follower.task
        s.caches["p0"].garbage = b"[" * 200_000
        s.caches["p0"].store(PROMPT[:4] + [1, 2, 3, 4])  # wakes the long poll
        await until(lambda: follower.state == ViewState.LOST)
        assert "RecursionError" in (follower.last_error or "")
        assert s.view.predict(PROMPT, [p]) is None
        await until(lambda: s.view.synced(p))
        assert follower.task is task and not task.done()
        assert s.view.predict(PROMPT, [p]) == {p: 28}


async def test_a_worker_that_does_not_report_is_routed_by_load() -> None:
    async with followed(("p0", "d0")) as s:
        p, d = s.urls["p0"], s.urls["d0"]
        s.caches["p0"].reporting = False
        await until(lambda: s.view.synced(d)
                    and s.view.followers[p].state == ViewState.NOT_REPORTING)
        assert s.view.predict(PROMPT, [p, d]) == {d: 0}
        assert s.view.all_synced_after_s is not None
        s.caches["p0"].reporting = True  # e.g. the worker was restarted with reporting on
        s.caches["p0"].store(PROMPT[:4])
        await until(lambda: s.view.predict(PROMPT, [p, d]) == {p: 4, d: 0})


async def test_a_router_restarted_mid_stream_has_the_same_index() -> None:
    """One view follows throughout; another stops mid-stream and a third starts later (a
    router restarted): once synced, all of them hold exactly what the workers hold."""
    async with followed(("p0", "p1", "d0")) as s:
        names = ("p0", "p1", "d0")
        urls = [s.urls[n] for n in names]
        steady = s.view
        stopped = s.new_view()
        prompts = [list(range(i * 100, i * 100 + 4 * (i + 3))) for i in range(6)]
        for i, prompt in enumerate(prompts[:3]):
            s.caches[names[i % 3]].store(prompt)
        await until(synced(stopped, *urls))
        await stopped.close()
        for i, prompt in enumerate(prompts[3:]):
            s.caches[names[i % 3]].store(prompt)
        s.caches["p1"].change(removed=prefix_keys(prompts[1], 4)[2:])
        s.caches["d0"].change(cleared=True, stored=prefix_keys(prompts[5], 4))
        restarted = s.new_view()
        try:
            for view in (steady, restarted):
                await until(lambda v=view: all(
                    v.synced(s.urls[n]) and v.index.keys_of(s.urls[n]) == s.caches[n].keys
                    for n in names))
            for prompt in prompts:
                assert steady.predict(prompt, urls) == restarted.predict(prompt, urls)
            assert len(steady.index) == len(restarted.index)
            assert restarted.all_synced_after_s is not None
        finally:
            await restarted.close()


async def test_a_report_that_is_not_exact_is_routed_by_load_until_it_is() -> None:
    async with followed() as s:
        p, d = s.urls["p0"], s.urls["d0"]
        s.caches["p0"].store(PROMPT)
        await until(lambda: s.view.predict(PROMPT, [p, d]) == {p: 28, d: 0})
        s.caches["p0"].exact = False  # the relay lost events it could not replay
        s.caches["p0"].change(stored=[1])
        await until(lambda: s.view.followers[p].state == ViewState.INEXACT)
        assert s.view.predict(PROMPT, [p, d]) == {d: 0}
        described = s.view.describe(p)
        assert described is not None and described["last_error"] == "events lost"
        s.caches["p0"].restart("e2")  # the engine cleared its cache: a new exact epoch
        s.caches["p0"].exact = True
        s.caches["p0"].store(PROMPT[:8])
        await until(lambda: s.view.predict(PROMPT, [p, d]) == {p: 8, d: 0}, timeout_s=5)


async def test_a_worker_whose_info_says_it_does_not_report_is_not_asked() -> None:
    async with followed() as s:
        p = s.urls["p0"]
        await until(synced(s.view, p))
        (worker,) = s.registry.find(p)
        info = {"role": "prefill", "engine_id": "x", "kv_events": False}
        s.registry.identified(worker, WorkerInfo.from_json(info))
        s.registry.identified(worker, WorkerInfo.from_json(info | {"engine_id": "y"}))
        await until(lambda: s.view.followers[p].state == ViewState.NOT_REPORTING)
        asked = len(s.caches["p0"].asked)
        await asyncio.sleep(0.5)  # longer than recheck_s: still not asked
        assert len(s.caches["p0"].asked) == asked
