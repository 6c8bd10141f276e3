"""The worker registry: who is in rotation, their KV endpoints and load, and the health loop.

Invariants:
- A worker takes new requests only while `routable` (healthy, not draining).
- `inflight` counts the router's own open legs on a worker; a removed worker is dropped only
  once it reaches zero, so removal loses no request.
- Health is a circuit breaker over consecutive outcomes: `unhealthy_after` failures (checks or
  connection-level request failures) take a worker out; `healthy_after` good checks bring it
  back. HTTP 429 and slow answers are back-pressure, never counted as failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from splitserve.common.load import LOAD_GAUGES, LOAD_PATH, parse_metrics
from splitserve.config import bearer_headers
from splitserve.router.config import WORKER_ROLES, RouterConfig
from splitserve.router.http import TRANSPORT_ERRORS

log = logging.getLogger("splitserve.router")


def kv_endpoint(info: dict[str, Any], transport: str | None = None) -> dict[str, Any] | None:
    """A worker's `/splitserve/info` as the target of a KV push (the P leg's
    `kv_transfer_params`, less the transfer's own fields; for NIXL: its side channel); None
    without a KV endpoint. Which connector drives a pair is `legs.LegProtocols.for_pair`'s
    choice, never this one's."""
    if not info or not info.get("kv_port"):
        return None
    endpoint = {"remote_host": info.get("kv_host"), "remote_port": info.get("kv_port"),
                "remote_engine_id": info.get("engine_id")}
    chosen = transport or info.get("transport")
    if chosen:
        endpoint["transport"] = chosen
    return endpoint


DEFAULT_CONNECTOR = "splitserve"


def connector_of(info: dict[str, Any] | None) -> str | None:
    """The connector a worker advertises in `/splitserve/info`; None for a plain vLLM worker
    (no info, or not read yet)."""
    if not info:
        return None
    return str(info.get("connector") or DEFAULT_CONNECTOR)


@dataclass
class Worker:
    """One worker as the router sees it. Mutated only on the router's event loop."""

    url: str
    role: str
    node: str | None = None  # where it runs, when the launcher knows (Ray: the node id)
    healthy: bool = False
    draining: bool = False
    successes: int = 0
    failures: int = 0
    last_error: str | None = None
    info: dict[str, Any] | None = None  # GET /splitserve/info; None for a plain vLLM worker
    # the load the policies read: a splitserve worker's light route; "/metrics" (parsed for the
    # same gauges) once the worker answered 404 (plain vLLM)
    load_path: str = LOAD_PATH
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    staged_bytes: float = 0.0
    staging_capacity_bytes: float = 0.0
    checked_at: float = 0.0
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def kv_endpoint(self, transport: str | None = None) -> dict[str, Any] | None:
        """This worker as the target of a KV push (the P leg's `kv_transfer_params`)."""
        return kv_endpoint(self.info, transport)

    def acquire(self, prompt_tokens: int = 0) -> None:
        self.inflight += 1
        self.inflight_prefill_tokens += prompt_tokens
        self.drained.clear()

    def release(self, prompt_tokens: int = 0) -> None:
        self.inflight -= 1
        self.inflight_prefill_tokens -= prompt_tokens
        if self.inflight == 0:
            self.drained.set()

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "node": self.node, "healthy": self.healthy,
                "draining": self.draining, "inflight": self.inflight,
                "inflight_prefill_tokens": self.inflight_prefill_tokens,
                "kv_usage": self.kv_usage, "running": self.running, "waiting": self.waiting,
                "staged_bytes": self.staged_bytes,
                "staging_capacity_bytes": self.staging_capacity_bytes,
                "kv_endpoint": self.kv_endpoint(), "last_error": self.last_error,
                "checked_age_s": round(time.monotonic() - self.checked_at, 3)
                if self.checked_at else None}


class Registry:
    """All workers, by role and URL. Its writers: the health loop, and whoever feeds it workers
    (the configured URLs at start, the admin endpoint, a discovery source) through `add`,
    `drain` and `remove`."""

    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession,
                 token: str | None) -> None:
        self.cfg = cfg
        self.session = session  # the app's one session to workers
        self.token = token
        self.headers = bearer_headers(token)  # on every request: workers require the token
        # Keyed by (role, url): one worker (role `both`) may serve in the P and the D pool.
        self.workers: dict[tuple[str, str], Worker] = {}
        for role, urls in (("prefill", cfg.prefill), ("decode", cfg.decode),
                           ("colocated", cfg.colocated)):
            for url in urls:
                self.workers[(role, url.rstrip("/"))] = Worker(url.rstrip("/"), role)

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def routable(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.routable]

    def add(self, url: str, role: str, node: str | None = None) -> Worker:
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}")
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        url = url.rstrip("/")
        if (role, url) in self.workers:
            raise ValueError(f"worker {url} is already registered as {role}")
        worker = Worker(url, role, node)
        self.workers[(role, url)] = worker
        return worker

    def find(self, url: str, role: str | None = None) -> list[Worker]:
        url = url.rstrip("/")
        return [w for (r, u), w in self.workers.items() if u == url and role in (None, r)]

    def drain(self, worker: Worker, draining: bool = True) -> None:
        """Stop (or, with `draining=False`, resume) sending `worker` new requests."""
        worker.draining = draining

    async def remove(self, worker: Worker) -> Worker:
        """Drain, wait for the worker's open legs to finish, then forget it."""
        worker.draining = True
        if worker.inflight:
            await asyncio.wait_for(worker.drained.wait(), self.cfg.drain_timeout_s)
        self.workers.pop((worker.role, worker.url), None)
        return worker

    # --- outcomes reported by the request path ----------------------------------------------
    def failed(self, worker: Worker, error: str) -> None:
        worker.failures += 1
        worker.successes = 0
        worker.last_error = error
        if worker.healthy and worker.failures >= self.cfg.unhealthy_after:
            worker.healthy = False
            log.warning("worker %s out of rotation: %s", worker.url, error)

    def succeeded(self, worker: Worker) -> None:
        worker.failures = 0

    # --- the health loop --------------------------------------------------------------------
    async def _get(self, worker: Worker, path: str) -> tuple[int, bytes]:
        """GET one of the worker's routes, read to the end: (status, body)."""
        async with self.session.get(
                f"{worker.url}{path}", headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)) as r:
            return r.status, await r.read()

    async def check(self, worker: Worker) -> None:
        try:
            status, _ = await self._get(worker, "/health")
            ok = status == 200
            error = None if ok else f"/health answered {status}"
        except TRANSPORT_ERRORS as exc:
            ok, error = False, f"/health: {type(exc).__name__}: {exc}"
        if ok:
            try:  # load and KV endpoint are advisory: a bad answer never fails the check
                await self._read_load(worker)
            except (*TRANSPORT_ERRORS, ValueError, TypeError) as exc:
                log.info("worker %s: cannot read load: %s", worker.url, exc)
        worker.checked_at = time.monotonic()
        if ok:
            worker.successes += 1
            worker.failures = 0
            first = worker.successes == 1 and worker.last_error is None
            if not worker.healthy and (first or worker.successes >= self.cfg.healthy_after):
                worker.healthy = True
                log.info("worker %s (%s) in rotation", worker.url, worker.role)
        else:
            self.failed(worker, error or "unhealthy")

    async def _read_load(self, worker: Worker) -> None:
        status, raw = await self._get(worker, worker.load_path)
        if status == 404 and worker.load_path == LOAD_PATH:
            worker.load_path = "/metrics"  # plain vLLM: no splitserve routes
            status, raw = await self._get(worker, "/metrics")
        if status == 200:
            load = (json.loads(raw) if worker.load_path == LOAD_PATH
                    else parse_metrics(raw.decode(errors="replace")).to_json())
            for key in LOAD_GAUGES.values():
                if isinstance(load.get(key), int | float):
                    setattr(worker, key, float(load[key]))
        if worker.role == "colocated" or not self.token:
            return
        if worker.info is None:
            status, raw = await self._get(worker, "/splitserve/info")
            # 200: its KV endpoint; 404: plain vLLM (never asked again); else: ask next time
            worker.info = json.loads(raw) if status == 200 else (
                {} if status == 404 else None)
            if worker.info == {}:
                log.warning("worker %s has no /splitserve/info (%s): plain vLLM, no KV transfer",
                            worker.url, status)
        if worker.role == "decode" and connector_of(worker.info) == DEFAULT_CONNECTOR:
            # staging (what D's /splitserve/state reports) is splitserve's connector's alone
            status, raw = await self._get(worker, "/splitserve/state")
            if status == 200:
                state = json.loads(raw)
                worker.staged_bytes = float(state.get("staged_bytes", 0))
                worker.staging_capacity_bytes = float(state.get("staging_capacity_bytes", 0))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

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
        for worker in list(self.workers.values()):
            try:
                status, raw = await self._get(worker, "/v1/models")
                if status == 200:
                    return dict(json.loads(raw)["data"][0])
                errors.append(f"{worker.url}: {status}")
            except TRANSPORT_ERRORS as exc:
                errors.append(f"{worker.url}: {exc}")
        raise RuntimeError(f"no worker answered /v1/models: {'; '.join(errors)}")
