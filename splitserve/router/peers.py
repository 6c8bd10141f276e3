"""The router's peers: the other routers in front of the same workers (`--peer URL ...`, or the
list a launcher sets at runtime with `PUT /admin/peers`).

Several routers share one pool without a coordinator. Each builds its own exact cache index from
the workers' cache reports (every worker serves any number of followers), and each serves the
legs it has open per worker at `GET /splitserve/router/load` (`RouterLoad`; deployment token).
Every `health_interval_s` a router reads each peer's answer, and a policy then sees per worker
its own open legs plus what its peers reported (`Worker.peers`): the in-flight load the engine
does not show yet (a P leg's queued prompt tokens, a D reserved before its KV arrives).

Contract:
- A peer's share counts only while its last read succeeded and is at most `STALE_INTERVALS`
  intervals old. A failed read drops it at once: a router that dies takes its legs with it
  (the workers abort them when its connections close), so its share must not outlive it.
- Only the sums reach `Worker.peers`; a router's own accounting (`Worker.accounting`) is never
  written here, so drains and admission count this router's legs alone.
- A peer's answer is advisory: it can skew balance for one interval, never a request's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Self

import aiohttp

from splitserve.common.wire import WireError
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.registry import Registry
from splitserve.router.worker import PeerShare, Worker

log = logging.getLogger("splitserve.router")

LOAD_ROUTE = "/splitserve/router/load"
STALE_INTERVALS = 3  # a peer's answer older than this many intervals no longer counts


def check_peer_url(url: str) -> str:
    """`url` without a trailing slash; ValueError unless it is an http(s) URL."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"peer router URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class LegLoad:
    """One router's open legs on one worker."""

    url: str
    pool: str
    inflight: int
    inflight_prefill_tokens: int


@dataclass(frozen=True)
class RouterLoad:
    """`GET /splitserve/router/load`: a router's open legs on each of its workers."""

    workers: tuple[LegLoad, ...]

    @classmethod
    def of(cls, workers: Iterable[Worker]) -> Self:
        return cls(tuple(LegLoad(w.url, w.pool.value, w.accounting.inflight,
                                 w.accounting.inflight_prefill_tokens) for w in workers))

    def to_json(self) -> dict[str, Any]:
        return {"workers": [{"url": w.url, "pool": w.pool, "inflight": w.inflight,
                             "inflight_prefill_tokens": w.inflight_prefill_tokens}
                            for w in self.workers]}

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        if not isinstance(raw, dict) or not isinstance(raw.get("workers"), list):
            raise WireError("router load must be {\"workers\": [...]}")
        out = []
        for w in raw["workers"]:
            if not isinstance(w, dict) or not isinstance(w.get("url"), str) \
                    or not isinstance(w.get("pool"), str):
                raise WireError("router load: each worker needs a url and a pool")
            counts = [w.get(k, 0) for k in ("inflight", "inflight_prefill_tokens")]
            if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                       for c in counts):
                raise WireError(f"router load: {w['url']}: counts must be non-negative integers")
            out.append(LegLoad(w["url"], w["pool"], counts[0], counts[1]))
        return cls(tuple(out))


@dataclass
class PeerRead:
    """A peer's last good answer and when it came (monotonic)."""

    load: RouterLoad
    at: float


class Peers:
    """Reads every peer each interval and writes the sums into the registry's workers."""

    def __init__(self, registry: Registry, session: aiohttp.ClientSession, urls: Iterable[str],
                 interval_s: float, timeout_s: float) -> None:
        self.registry = registry
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.urls: tuple[str, ...] = ()
        self.reads: dict[str, PeerRead] = {}
        self.errors: dict[str, str] = {}
        self.task: asyncio.Task[None] | None = None
        self.set(urls)

    def set(self, urls: Iterable[str]) -> None:
        """The peer list from now on (ValueError on a bad URL; nothing changes then)."""
        self.urls = tuple(dict.fromkeys(check_peer_url(u) for u in urls))
        for gone in set(self.reads) - set(self.urls):
            del self.reads[gone]
        self.errors = {u: e for u, e in self.errors.items() if u in self.urls}
        self.apply(time.monotonic())

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        while True:
            await self.read_all()
            await asyncio.sleep(self.interval_s)

    async def read_all(self) -> None:
        await asyncio.gather(*(self._read(url) for url in self.urls))
        self.apply(time.monotonic())

    async def _read(self, url: str) -> None:
        try:
            async with self.session.get(
                    url + LOAD_ROUTE,
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    raise WireError(f"{LOAD_ROUTE} answered {r.status}")
                load = RouterLoad.from_json(await r.json(content_type=None))
        except Exception as exc:  # transport, WireError and bad JSON (ValueErrors), any other
            if url not in self.urls:  # removed by `set` while this read was in flight
                return
            if url not in self.errors:
                log.warning("peer router %s: %s: its share no longer counts", url, exc,
                            exc_info=not isinstance(exc, (*TRANSPORT_ERRORS, ValueError)))
            self.errors[url] = f"{type(exc).__name__}: {exc}"
            self.reads.pop(url, None)
            return
        if url not in self.urls:
            return
        if url in self.errors:
            log.info("peer router %s answers again", url)
        self.errors.pop(url, None)
        self.reads[url] = PeerRead(load, time.monotonic())

    def apply(self, now: float) -> None:
        """Every worker's `peers` := the sums over the peers whose answer still counts."""
        fresh = [r.load for r in self.reads.values()
                 if now - r.at <= STALE_INTERVALS * self.interval_s]
        sums = shares(fresh)
        for w in self.registry.all():
            w.peers = sums.get((w.pool.value, w.url), PeerShare())

    def describe(self) -> list[dict[str, Any]]:
        """Each peer: its URL, whether its share counts, its last error."""
        now = time.monotonic()
        return [{"url": u, "counted": u in self.reads
                 and now - self.reads[u].at <= STALE_INTERVALS * self.interval_s,
                 "last_error": self.errors.get(u)} for u in self.urls]


def shares(loads: Iterable[RouterLoad]) -> Mapping[tuple[str, str], PeerShare]:
    """The summed open legs of `loads`, by (pool, worker URL)."""
    out: dict[tuple[str, str], PeerShare] = {}
    for load in loads:
        for leg in load.workers:
            key = (leg.pool, leg.url.rstrip("/"))
            s = out.get(key, PeerShare())
            out[key] = PeerShare(s.inflight + leg.inflight,
                                 s.inflight_prefill_tokens + leg.inflight_prefill_tokens)
    return out
