"""The worker registry: every worker by pool and URL, and the one place their membership,
health and identity change, each change announced to listeners as a `WorkerEvent`.

Writers: whoever feeds it workers (the configured URLs at start, the admin endpoint, a launcher)
through `add`, `drain` and `remove`; the health loop (`health.HealthLoop`) through `checked`,
`identified` and `reported`; the request path through `failed` and `succeeded`.

Events, in the order they happen (listeners are called synchronously, on the event loop, in
subscription order; one that raises is logged and skipped, never breaks the writer):
- `ADDED`: a worker joined (not yet in rotation: its first good check brings it in).
- `REMOVED`: it left, after its open legs finished (`remove` drains first).
- `HEALTHY` / `UNHEALTHY`: the circuit breaker took it into / out of rotation.
- `DRAINING` / `UNDRAINED`: the operator stopped / resumed sending it new requests.
- `RESTARTED`: it is not the worker it was: the `/splitserve/info` read again differs from the
  last one read (a new `engine_id`, or any other field; `previous` is the old one). Anything a
  listener keeps about that worker's engine (its KV cache) is gone.

The restart rule (the health loop applies it): a worker's info is read at its first good check,
and read again at the first good check after any failure (a failed check, or a connection-level
failure of a request). An engine restart cannot pass unnoticed between two checks: vLLM takes
far longer to start than a health interval, so its checks fail meanwhile, and the re-read
shows the new identity (vLLM draws a fresh `engine_id` per start unless one is configured). A
re-read that comes back the same announces nothing. `RESTARTED` comes before the `HEALTHY` of
the same check. A plain vLLM worker has no info, so its restarts are not seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from splitserve.common.vocab import Pool, values
from splitserve.common.wire import WorkerInfo, WorkerLoad
from splitserve.router.config import RouterConfig
from splitserve.router.worker import Staging, Worker

log = logging.getLogger("splitserve.router")


class EventKind(StrEnum):
    ADDED = "added"
    REMOVED = "removed"
    RESTARTED = "restarted"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    UNDRAINED = "undrained"


@dataclass(frozen=True)
class WorkerEvent:
    """One change of one worker. `previous`: for `RESTARTED`, the info it had before."""

    kind: EventKind
    worker: Worker
    previous: WorkerInfo | None = None


Listener = Callable[[WorkerEvent], None]


class Registry:
    """All workers, keyed by (pool, url): one worker (role `both`) may serve in P and in D."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self._workers: dict[tuple[Pool, str], Worker] = {}
        self._listeners: list[Listener] = []
        for pool, urls in ((Pool.PREFILL, cfg.prefill), (Pool.DECODE, cfg.decode),
                           (Pool.COLOCATED, cfg.colocated)):
            for url in urls:
                self.add(url, pool)

    # --- listeners --------------------------------------------------------------------------
    def subscribe(self, listener: Listener, replay: bool = False) -> Callable[[], None]:
        """Call `listener` with every later event (with `replay`, first an `ADDED` for every
        worker already here). Returns the call that unsubscribes it."""
        self._listeners.append(listener)
        if replay:
            for worker in self.all():
                self._tell(listener, WorkerEvent(EventKind.ADDED, worker))

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)
        return unsubscribe

    def _announce(self, kind: EventKind, worker: Worker, previous: WorkerInfo | None = None
                  ) -> None:
        event = WorkerEvent(kind, worker, previous)
        for listener in list(self._listeners):
            self._tell(listener, event)

    @staticmethod
    def _tell(listener: Listener, event: WorkerEvent) -> None:
        try:
            listener(event)
        except Exception:  # a listener's bug must not break the health loop or a request
            log.exception("worker event listener failed on %s %s", event.kind,
                          event.worker.url)

    # --- reading ----------------------------------------------------------------------------
    @property
    def workers(self) -> Mapping[tuple[Pool, str], Worker]:
        """Every worker by (pool, url), read-only: change it through the methods below."""
        return MappingProxyType(self._workers)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def by_pool(self, pool: Pool) -> list[Worker]:
        return [w for w in self._workers.values() if w.pool == pool]

    def routable(self, pool: Pool) -> list[Worker]:
        return [w for w in self._workers.values() if w.pool == pool and w.routable]

    def find(self, url: str, pool: Pool | str | None = None) -> list[Worker]:
        url = url.rstrip("/")
        return [w for (p, u), w in self._workers.items() if u == url and pool in (None, p)]

    # --- membership -------------------------------------------------------------------------
    def add(self, url: str, pool: Pool | str, node: str | None = None) -> Worker:
        if pool not in values(Pool):
            raise ValueError(f"role must be one of {values(Pool)}")
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        worker = Worker(url, pool, node)
        if (worker.pool, worker.url) in self._workers:
            raise ValueError(f"worker {worker.url} is already registered as {worker.pool}")
        self._workers[(worker.pool, worker.url)] = worker
        self._announce(EventKind.ADDED, worker)
        return worker

    def set_node(self, worker: Worker, node: str) -> None:
        """Label where `worker` runs (a launcher naming the workers the router started with)."""
        worker.identity.node = node

    def drain(self, worker: Worker, draining: bool = True) -> None:
        """Stop (or, with `draining=False`, resume) sending `worker` new requests."""
        if worker.draining != draining:
            worker.draining = draining
            self._announce(EventKind.DRAINING if draining else EventKind.UNDRAINED, worker)

    async def remove(self, worker: Worker) -> Worker:
        """Drain, wait for the worker's open legs to finish, then forget it. TimeoutError after
        the drain timeout (the worker stays, draining)."""
        self.drain(worker)
        if worker.accounting.inflight:
            await asyncio.wait_for(worker.drained.wait(), self.cfg.drain_timeout_s)
        if self._workers.pop((worker.pool, worker.url), None) is not None:
            self._announce(EventKind.REMOVED, worker)
        return worker

    # --- the circuit breaker ----------------------------------------------------------------
    def failed(self, worker: Worker, error: str) -> None:
        """A failed check or a connection-level request failure."""
        h = worker.health
        h.failures += 1
        h.successes = 0
        h.last_error = error
        worker.identity.stale = True  # the next good check reads its info again
        if h.healthy and h.failures >= self.cfg.unhealthy_after:
            h.healthy = False
            log.warning("worker %s out of rotation: %s", worker.url, error)
            self._announce(EventKind.UNHEALTHY, worker)

    def succeeded(self, worker: Worker) -> None:
        """A request on `worker` succeeded."""
        worker.health.failures = 0

    def checked(self, worker: Worker, now: float) -> None:
        """A good health check at `now` (monotonic): back in rotation at once if it never
        failed, else after `healthy_after` good checks in a row."""
        h = worker.health
        h.checked_at = now
        h.successes += 1
        h.failures = 0
        first = h.successes == 1 and h.last_error is None
        if not h.healthy and (first or h.successes >= self.cfg.healthy_after):
            h.healthy = True
            log.info("worker %s (%s) in rotation", worker.url, worker.pool)
            self._announce(EventKind.HEALTHY, worker)

    # --- what the health loop read ----------------------------------------------------------
    def identified(self, worker: Worker, info: WorkerInfo | None) -> None:
        """`/splitserve/info` answered: `info`, or None for 404 (a plain vLLM worker)."""
        ident = worker.identity
        known = ident.info is not None or ident.plain
        previous = ident.info
        ident.info, ident.plain, ident.stale = info, info is None, False
        if known and info != previous:
            log.warning("worker %s restarted: %s -> %s", worker.url,
                        previous and previous.engine_id, info and info.engine_id)
            self._announce(EventKind.RESTARTED, worker, previous)

    def reported(self, worker: Worker, load: WorkerLoad | None = None,
                 staging: Staging | None = None) -> None:
        """The worker's load (and its connector's staging) as last read. No event: load
        changes every check."""
        if load is not None:
            worker.load.engine = load
        if staging is not None:
            worker.load.staging = staging
