"""The router's view of every worker's prefix cache: one follower per worker, feeding the exact
index (`kvindex.index.KvIndex`) from the worker's cache report (`kvindex.messages`: a snapshot,
then a long poll of the changes after it).

A follower per worker URL (one engine serving in two pools is followed once), started when the
registry announces the worker (`ADDED`; a router started after its workers gets an `ADDED` for
each of them at once), stopped and forgotten when the last pool lets it go (`REMOVED`). Its
loop: take a snapshot, then long-poll `events?after=SEQ&wait_s=W`, applying each answer. It
forgets the worker's view and takes a new snapshot on `410 Gone` (it fell behind), on a change
that does not continue the view (a sequence gap) and on a new epoch (the engine restarted, or
its relay started over), and on the registry's `RESTARTED`. A worker that answers 404 on the
snapshot route does not report its cache (401 or 403: not to this router, which has no
deployment token): asked again every `recheck_s`, and at once when it comes back into rotation
or restarts; so is one whose `/splitserve/info` says `kv_events: false`, without asking. A
snapshot with `exact: false` (the worker reports but cannot vouch for its engine's cache: prefix
caching off, events it could not replay) leaves the view out, asked again after 1 s doubling
to `recheck_s`. A transport error or a malformed answer forgets the view and retries after a
backoff (0.1 s doubling to 5 s, jittered), or at once when the worker comes back into rotation.

Only a synced view is in the index: a worker whose view is not synced (starting, lost,
resyncing, not reporting, inexact) is left out of `predict`, so `cache` scores it as holding
nothing, as `load` does, and `splitserve_router_worker_kv_synced` is 0 for it. The index is
only ever a prediction: every request is exact whatever it says (a worker recomputes what it
lacks).

Requests go over the app's one session, whose default headers carry the deployment token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import quote

import aiohttp

from splitserve.common.vocab import Pool
from splitserve.kvindex.index import KvIndex, OutOfSync
from splitserve.kvindex.messages import EVENTS_PATH, SNAPSHOT_PATH, KvEvents, KvSnapshot
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.metrics import RouterMetrics
from splitserve.router.registry import EventKind, Registry, WorkerEvent
from splitserve.routing.prefix import reusable

log = logging.getLogger("splitserve.router")

# Measured bytes of the index per distinct block (`kvindex.index`), for the size gauge.
INDEX_BYTES_PER_BLOCK = 88


class ViewState(StrEnum):
    STARTING = "starting"  # no snapshot read yet
    SYNCED = "synced"  # snapshot + every change since: exact
    RESYNCING = "resyncing"  # forgotten; a new snapshot is on its way (410, gap, epoch)
    LOST = "lost"  # the stream failed; retrying after a backoff
    NOT_REPORTING = "not_reporting"  # 404 on the snapshot route, or its info says it does not
    INEXACT = "inexact"  # it reports, but cannot vouch for its engine's cache (`exact: false`)


@dataclass(frozen=True)
class Follow:
    """How the view of the workers' caches is read (the router's defaults)."""

    wait_s: float = 10.0  # the long poll's wait; the request's timeout adds `timeout_s`
    timeout_s: float = 5.0
    recheck_s: float = 30.0  # a worker that does not report is asked again after this
    inexact_min_s: float = 1.0  # a report not exact: asked again after this, doubling to recheck
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0


@dataclass
class Follower:
    """One worker's follower and what it shows in `/workers`."""

    url: str
    pools: set[Pool]
    state: ViewState = ViewState.STARTING
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.monotonic)
    synced_after_s: float | None = None  # start (or restart) -> first synced snapshot
    seq: int = 0
    epoch: str | None = None
    resyncs: int = 0
    last_error: str | None = None
    lag_s: float | None = None  # the last applied change: apply time - its `ts`


class CacheView:
    """Every worker's follower, the index they feed, and what routing asks of it."""

    def __init__(self, registry: Registry, session: aiohttp.ClientSession,
                 metrics: RouterMetrics, follow: Follow | None = None) -> None:
        self.registry = registry
        self.session = session
        self.metrics = metrics
        self.follow = follow or Follow()
        self.index = KvIndex()
        self.followers: dict[str, Follower] = {}
        self.started = time.monotonic()
        self.all_synced_after_s: float | None = None  # router start -> every reporter synced
        self._unsubscribe = registry.subscribe(self.on_event, replay=True)

    # --- the registry's events --------------------------------------------------------------
    def on_event(self, event: WorkerEvent) -> None:
        url, pool = event.worker.url, event.worker.pool
        f = self.followers.get(url)
        if event.kind == EventKind.ADDED:
            if f is None:
                f = self.followers[url] = Follower(url, {pool})
                self._start(f)
            f.pools.add(pool)
        elif f is None:
            return
        elif event.kind == EventKind.REMOVED:
            f.pools.discard(pool)
            if not f.pools:
                self._stop(f)
                del self.followers[url]
                self.index.forget(url)
        elif event.kind == EventKind.RESTARTED:
            self._resync(f, "restart")
            self._stop(f)
            self._start(f)
        elif event.kind == EventKind.HEALTHY and f.state in (
                ViewState.LOST, ViewState.NOT_REPORTING, ViewState.INEXACT):
            f.wake.set()  # back in rotation: try now, not after the backoff

    def _start(self, f: Follower) -> None:
        f.started = time.monotonic()
        f.synced_after_s = None
        f.state = ViewState.STARTING
        f.wake = asyncio.Event()
        f.task = asyncio.get_running_loop().create_task(self._run(f), name=f"kv-{f.url}")

    def _stop(self, f: Follower) -> None:
        if f.task is not None:
            f.task.cancel()
            f.task = None

    async def close(self) -> None:
        self._unsubscribe()
        tasks = [f.task for f in self.followers.values() if f.task is not None]
        for f in self.followers.values():
            self._stop(f)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- routing's questions ----------------------------------------------------------------
    def synced(self, url: str) -> bool:
        f = self.followers.get(url)
        return f is not None and f.state == ViewState.SYNCED

    def predict(self, token_ids: Sequence[int], urls: Iterable[str]) -> dict[str, int] | None:
        """The prompt tokens each of `urls` holds as a cached prefix, for the synced ones
        (others are left out: not known); None when no worker's view is synced."""
        known = [u for u in urls if u in self.index]
        if not known:
            return None
        if not len(self.index):  # synced, and nothing cached anywhere: no need to key it
            return dict.fromkeys(known, 0)
        return self.index.matched(known, token_ids)

    def reusable(self, url: str, cached: int, prompt_len: int) -> int:
        """Of `cached` prompt tokens held on `url`, those its engine reuses for a prompt of
        `prompt_len` tokens: vLLM computes at least the last prompt token, so at most the
        largest multiple of its block size below `prompt_len`."""
        known = self.index.worker(url)
        if known is None:
            return 0
        return reusable(cached, prompt_len, known.block_size)

    def summary(self) -> dict[str, Any]:
        """The index in `/workers`: distinct blocks, bytes (measured per block), and the
        seconds from the router's start until every reporting worker's view was synced."""
        n = len(self.index)
        return {"blocks": n, "bytes": n * INDEX_BYTES_PER_BLOCK,
                "all_synced_after_s": self.all_synced_after_s}

    def describe(self, url: str) -> dict[str, Any] | None:
        """The worker's cache in `/workers`: sync state, blocks and tokens held."""
        f = self.followers.get(url)
        if f is None:
            return None
        known = self.index.worker(url)
        return {"state": f.state.value, "synced": f.state == ViewState.SYNCED,
                "blocks": 0 if known is None else known.blocks,
                "tokens": 0 if known is None else known.blocks * known.block_size,
                "block_size": None if known is None else known.block_size,
                "epoch": f.epoch, "seq": f.seq, "resyncs": f.resyncs,
                "synced_after_s": f.synced_after_s,
                "lag_s": None if f.lag_s is None else round(f.lag_s, 6),
                "last_error": f.last_error}

    # --- one worker's follower --------------------------------------------------------------
    def _says_it_reports(self, f: Follower) -> bool:
        """False when the worker's `/splitserve/info`, once read, says it keeps no report."""
        infos = [w.info for w in self.registry.find(f.url) if w.info is not None]
        return not infos or any(i.kv_events for i in infos)

    async def _run(self, f: Follower) -> None:
        backoff = self.follow.backoff_min_s
        inexact = self.follow.inexact_min_s
        churn = 0.0  # the pause before a snapshot that follows another one closely
        while True:
            try:
                got = await self._snapshot(f) if self._says_it_reports(f) else None
                if got is None:
                    f.state = ViewState.NOT_REPORTING
                    self.index.forget(f.url)
                    await self._pause(f, self.follow.recheck_s)
                    continue
                if not got.exact:  # asked again, less and less often, until it is exact
                    f.state, f.last_error = ViewState.INEXACT, got.reason or "not exact"
                    self.index.forget(f.url)
                    await self._pause(f, inexact)
                    inexact = min(inexact * 2, self.follow.recheck_s)
                    continue
                backoff, inexact = self.follow.backoff_min_s, self.follow.inexact_min_s
                tailed = time.monotonic()
                await self._tail(f)  # returns when a new snapshot is needed
                if time.monotonic() - tailed < self.follow.backoff_max_s:
                    # resyncs in quick succession (e.g. two engines' reports behind one URL,
                    # each of its own epoch): each snapshot costs the worker and this loop the
                    # whole cache, so back off as for a lost stream
                    await self._pause(f, churn)
                    churn = min(max(churn * 2, self.follow.backoff_min_s),
                                self.follow.backoff_max_s)
                else:
                    churn = 0.0
            except Exception as exc:  # transport, WireError and JSON (ValueErrors), any other:
                # the view is lost, never left frozen; the follower backs off and rebuilds it
                was = f.state
                if was == ViewState.SYNCED:
                    self._resync(f, "lost")
                f.state = ViewState.LOST
                f.last_error = f"{type(exc).__name__}: {exc}"
                self.index.forget(f.url)
                expected = isinstance(exc, (*TRANSPORT_ERRORS, ValueError))
                log.log(logging.WARNING if was == ViewState.SYNCED or not expected
                        else logging.DEBUG,
                        "worker %s: cache report lost (%s); routed by load until rebuilt",
                        f.url, f.last_error, exc_info=not expected)
                await self._pause(f, backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.follow.backoff_max_s)

    async def _pause(self, f: Follower, seconds: float) -> None:
        f.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(f.wake.wait(), seconds)

    async def _get(self, f: Follower, path: str, timeout_s: float) -> tuple[int, bytes]:
        async with self.session.get(f"{f.url}{path}",
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, await r.read()

    async def _snapshot(self, f: Follower) -> KvSnapshot | None:
        """Read a snapshot and apply it when it is exact; None when the worker does not report
        (404)."""
        status, raw = await self._get(f, SNAPSHOT_PATH, self.follow.timeout_s)
        if status in (401, 403, 404):  # no such route, or not for us (no deployment token)
            f.last_error = None if status == 404 else f"snapshot answered {status}"
            return None
        if status != 200:
            raise ValueError(f"snapshot answered {status}")
        snap = KvSnapshot.from_json(json.loads(raw))
        if not snap.exact:
            return snap
        self.index.apply_snapshot(f.url, snap)
        f.state, f.seq, f.epoch, f.last_error = ViewState.SYNCED, snap.seq, snap.epoch, None
        now = time.monotonic()
        if f.synced_after_s is None:
            f.synced_after_s = round(now - f.started, 6)
            self._check_all_synced(now)
        return snap

    def _check_all_synced(self, now: float) -> None:
        if self.all_synced_after_s is not None:
            return
        if all(f.state in (ViewState.SYNCED, ViewState.NOT_REPORTING, ViewState.INEXACT)
               for f in self.followers.values()):
            self.all_synced_after_s = round(now - self.started, 6)
            log.info("kv index: every reporting worker synced %.3f s after the router started",
                     self.all_synced_after_s)

    async def _tail(self, f: Follower) -> None:
        """Long-poll the changes after the view's seq and apply them, until a new snapshot is
        needed (410, a gap, a new epoch: the view is then forgotten)."""
        wait = self.follow.wait_s
        while True:
            status, raw = await self._get(
                f, f"{EVENTS_PATH}?after={f.seq}&wait_s={wait:g}&epoch={quote(f.epoch or '')}",
                wait + self.follow.timeout_s)
            if status == 410:
                self._resync(f, "gone")
                return
            if status != 200:
                raise ValueError(f"events answered {status}")
            events = KvEvents.from_json(json.loads(raw))
            try:
                applied = self.index.apply_events(f.url, events)
            except OutOfSync as exc:
                self._resync(f, exc.reason)
                return
            if applied:
                f.seq = applied[-1].seq
                now = time.time()
                for change in applied:
                    self.metrics.kv_event_lag.observe(max(now - change.ts, 0.0))
                f.lag_s = now - applied[-1].ts

    def _resync(self, f: Follower, reason: str) -> None:
        """Forget `f`'s view for a new snapshot, counted by reason."""
        self.index.forget(f.url)
        f.resyncs += 1
        f.state = ViewState.RESYNCING
        self.metrics.kv_resyncs.labels(f.url, reason).inc()
        log.info("worker %s: cache view resync (%s)", f.url, reason)
