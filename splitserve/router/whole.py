"""The unsplit path: one worker runs the request unchanged — its very bytes — and its answer is
relayed as is. Used by colocated pools and for requests whose parameters the seeded two-leg flow
cannot honour: the hot path of a colocated deployment.

Retries (`--whole-retries`) go to another worker before the first byte only; closing a response
mid-stream aborts the request in vLLM.
"""

from __future__ import annotations

import aiohttp
from yarl import URL

from splitserve.common.vocab import Pool
from splitserve.router.config import RouterConfig
from splitserve.router.failures import (
    RETRYABLE_STATUS,
    LegFailed,
    Retry,
    exhausted,
)
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import Picker
from splitserve.router.registry import Registry
from splitserve.router.timings import Timings
from splitserve.router.worker import Worker


class Passthrough:
    def __init__(self, cfg: RouterConfig, registry: Registry, picker: Picker,
                 metrics: RouterMetrics, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.registry = registry
        self.picker = picker
        self.metrics = metrics
        self.session = session
        self._urls: dict[tuple[str, str], URL] = {}  # parsed once per worker and path

    def url(self, worker: Worker, path: str) -> URL:
        key = (worker.url, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 1024:  # workers come and go: never grows without bound
                self._urls.clear()
            url = self._urls[key] = URL(f"{worker.url}{path}")
        return url

    def pick(self, exclude: set[str]) -> Worker:
        """A colocated worker if any is in rotation, else a decode worker."""
        for role in (Pool.COLOCATED, Pool.DECODE):
            pool = [w for w in self.registry.routable(role) if w.url not in exclude]
            if pool:
                return self.picker.colocated(pool)
        return self.picker.colocated([])

    async def complete(self, path: str, raw: bytes, rid: str, t: Timings
                       ) -> tuple[int, bytes, str | None]:
        """A non-streaming request: (status, body, content type)."""
        r, w = await self.open(path, raw, rid, t)
        try:
            return r.status, await r.read(), r.headers.get("Content-Type")
        finally:
            r.release()
            w.release()

    async def open(self, path: str, raw: bytes, rid: str, t: Timings
                   ) -> tuple[aiohttp.ClientResponse, Worker]:
        """Open the request on one worker (retries as `pick` chooses). The caller reads `r`,
        then releases (read to the end) or closes it (abort), and releases `w`."""
        retry = Retry(self.cfg, self.metrics, self.registry, "whole", self.cfg.whole_retries,
                      t, rid)
        for attempt in retry:
            await retry.begin(attempt)
            w = self.pick(retry.tried)
            t.decode_url = w.url
            w.acquire()
            r: aiohttp.ClientResponse | None = None
            try:
                r = await self.session.post(self.url(w, path), data=raw, headers={
                    "X-Request-Id": rid, "Content-Type": "application/json"})
                if r.status in RETRYABLE_STATUS:
                    text = (await r.read())[:200].decode(errors="replace")
                    r.release()
                    raise LegFailed(f"http_{r.status}", text, r.status)
                return r, w
            except (*TRANSPORT_ERRORS, LegFailed) as exc:
                w.release()
                retry.failed(w, exc)
            except BaseException:  # the client left (CancelledError): give `w` back, and go
                if r is not None:
                    r.close()
                w.release()
                raise
        raise exhausted(retry.last, w.pool.value, "request")
