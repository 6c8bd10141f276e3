"""The health loop: checks every worker each interval and tells the registry what it found,
through the registry's methods, so every change of rotation or identity is announced there.

Per worker and round: `GET /health`; on 200, the load (advisory: a bad answer never fails the
check) — `/splitserve/load`, or the same gauges out of `/metrics` for a plain vLLM worker —,
the worker's `/splitserve/info` when the registry's restart rule asks for it (P and D, with a
deployment token), and for D whatever its connector's leg protocol polls (splitserve: its
staging). Every answer is parsed once into its `common.wire` type.

Health is a circuit breaker over consecutive outcomes (`Registry.failed` / `checked`):
`unhealthy_after` failures (checks, or connection-level request failures) take a worker out;
`healthy_after` good checks bring it back. HTTP 429 and slow answers are back-pressure, never
counted as failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from splitserve.common.load import LOAD_PATH, parse_metrics
from splitserve.common.vocab import Pool
from splitserve.common.wire import WorkerInfo, WorkerLoad
from splitserve.config import bearer_headers
from splitserve.router.config import RouterConfig
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.legs import LegProtocols
from splitserve.router.registry import Registry
from splitserve.router.worker import Worker

log = logging.getLogger("splitserve.router")

# what an advisory answer out of shape raises (WireError is a ValueError; RecursionError:
# JSON nested past the parser's depth)
ADVISORY_ERRORS = (*TRANSPORT_ERRORS, ValueError, RecursionError)


class HealthLoop:
    """Checks the registry's workers over the app's one session to them."""

    def __init__(self, cfg: RouterConfig, registry: Registry, session: aiohttp.ClientSession,
                 token: str | None, protocols: LegProtocols) -> None:
        self.cfg = cfg
        self.registry = registry
        self.session = session
        self.token = token
        self.headers = bearer_headers(token)  # on every request: workers require the token
        self.protocols = protocols

    async def get(self, worker: Worker, path: str) -> tuple[int, bytes]:
        """GET one of the worker's routes, read to the end: (status, body)."""
        async with self.session.get(
                f"{worker.url}{path}", headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)) as r:
            return r.status, await r.read()

    async def check(self, worker: Worker) -> None:
        try:
            status, _ = await self.get(worker, "/health")
            error = None if status == 200 else f"/health answered {status}"
        except TRANSPORT_ERRORS as exc:
            error = f"/health: {type(exc).__name__}: {exc}"
        if error is not None:
            worker.health.checked_at = time.monotonic()
            self.registry.failed(worker, error)
            return
        # load and identity are advisory: a bad answer never fails the check, and one that
        # cannot be read does not keep the other from being read
        try:
            self.registry.reported(worker, await self._load(worker))
        except ADVISORY_ERRORS as exc:
            log.info("worker %s: cannot read load: %s", worker.url, exc)
        try:
            await self._identify(worker)
        except ADVISORY_ERRORS as exc:
            log.info("worker %s: cannot read its identity or connector: %s", worker.url, exc)
        self.registry.checked(worker, time.monotonic())

    async def _identify(self, worker: Worker) -> None:
        """Its `/splitserve/info` when the restart rule asks, then what its leg protocol polls."""
        if worker.pool == Pool.COLOCATED or not self.token:
            return
        if worker.identity.stale:
            status, raw = await self.get(worker, "/splitserve/info")
            # 200: what it is; 404: plain vLLM; else: ask again next time
            if status in (200, 404):
                if status == 404 and not worker.identity.plain:
                    log.warning("worker %s has no /splitserve/info: plain vLLM, no KV transfer",
                                worker.url)
                self.registry.identified(
                    worker, WorkerInfo.from_json(json.loads(raw)) if status == 200 else None)
        proto = self.protocols.for_worker(worker)
        if worker.pool == Pool.PREFILL and proto is not None:
            await proto.poll_prefill(worker)
        if worker.pool == Pool.DECODE and proto is not None:
            staging = await proto.poll_staging(lambda path: self.get(worker, path))
            if staging is not None:
                self.registry.reported(worker, staging=staging)

    async def _load(self, worker: Worker) -> WorkerLoad | None:
        load = worker.load
        status, raw = await self.get(worker, load.path)
        if status == 404 and load.path == LOAD_PATH:
            load.path = "/metrics"  # plain vLLM: no splitserve routes
            status, raw = await self.get(worker, load.path)
        if status != 200:
            return None
        if load.path == LOAD_PATH:
            return WorkerLoad.from_json(json.loads(raw))
        return parse_metrics(raw.decode(errors="replace"))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.all()))

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # the loop must outlive any one bad answer
                log.exception("health check round failed")
            await asyncio.sleep(self.cfg.health_interval_s)

    async def model(self) -> dict[str, Any]:
        """The served model (`id`, `root`) from the first worker that answers /v1/models."""
        errors = []
        for worker in self.registry.all():
            try:
                status, raw = await self.get(worker, "/v1/models")
                if status == 200:
                    model = json.loads(raw)["data"][0]
                    if isinstance(model, dict) and isinstance(model.get("id"), str):
                        return dict(model)
                    errors.append(f"{worker.url}: a model without an id")
                    continue
                errors.append(f"{worker.url}: {status}")
            except TRANSPORT_ERRORS as exc:
                errors.append(f"{worker.url}: {exc}")
            except (ValueError, LookupError, TypeError, RecursionError) as exc:  # no model list
                errors.append(f"{worker.url}: /v1/models out of shape ({exc!r:.80})")
        raise RuntimeError(f"no worker answered /v1/models: {'; '.join(errors)}")
