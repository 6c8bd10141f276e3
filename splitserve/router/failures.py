"""What a failed leg means: which answers are worth a retry elsewhere, which count against the
worker (the circuit breaker), the backoff between attempts, and the answer once every attempt
failed. Shared by the split legs (`flow`) and the unsplit path (`whole`)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from splitserve.router.config import RouterConfig
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import Overloaded
from splitserve.router.registry import Registry
from splitserve.router.worker import Worker

if TYPE_CHECKING:
    from splitserve.router.timings import Timings

log = logging.getLogger("splitserve.router")
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class UpstreamError(Exception):
    """A leg ended in an error that is the answer (a 4xx from vLLM, or retries exhausted)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def is_backpressure(exc: Exception) -> bool:
    """429/503 from a worker: it is alive and says "not now" (vLLM's queue limits answer 503)."""
    return isinstance(exc, LegFailed) and exc.status in (429, 503)


def counts_against_worker(exc: Exception) -> bool:
    """Only connection-level failures (refused, reset, timed out, a stream cut short) trip the
    circuit breaker. An HTTP answer is the worker speaking: back-pressure, or an error about this
    request; a worker whose engine is dead fails its health checks instead."""
    return not isinstance(exc, LegFailed) or exc.cause == "stream_cut"


async def backoff(cfg: RouterConfig, attempt: int) -> None:
    """Before retry `attempt + 1`: exponential, capped, with ±20 % jitter."""
    base = min(cfg.retry_backoff_s * 1.5**attempt, cfg.retry_backoff_max_s)
    await asyncio.sleep(base * random.uniform(0.8, 1.2))


def leg_failed(metrics: RouterMetrics, registry: Registry, worker: Worker, leg: str,
               exc: Exception, rid: str) -> None:
    """Count a failed leg by cause; only a connection-level failure counts against the worker."""
    cause = exc.cause if isinstance(exc, LegFailed) else type(exc).__name__
    metrics.failures.labels(leg, cause).inc()
    if counts_against_worker(exc):
        registry.failed(worker, str(exc))
    log.warning("request %s: %s leg on %s failed: %s", rid, leg, worker.url, exc)


class Retry:
    """The attempts of one leg: `limit` retries after the first attempt, each counted (in the
    request's timings and the `retries` metric of `leg`) and preceded by the backoff; the
    workers tried so far and the last failure.

        for attempt in retry:
            await retry.begin(attempt)
            ...  # on a failure worth a retry: retry.failed(worker, exc); next attempt
        raise exhausted(retry.last, ...)
    """

    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics, registry: Registry, leg: str,
                 limit: int, t: Timings, rid: str) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.registry = registry
        self.leg = leg
        self.limit = limit
        self.t = t
        self.rid = rid
        self.tried: set[str] = set()
        self.last: Exception | None = None

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.limit + 1))

    async def begin(self, attempt: int) -> None:
        """Before attempt `attempt`: nothing for the first; count and back off for a retry."""
        if attempt:
            self.t.retries += 1
            self.metrics.retries.labels(self.leg).inc()
            await backoff(self.cfg, attempt - 1)

    def failed(self, worker: Worker, exc: Exception) -> None:
        """The attempt on `worker` failed with `exc`: counted, and `worker` not tried again
        while another is left."""
        self.tried.add(worker.url)
        leg_failed(self.metrics, self.registry, worker, self.leg, exc, self.rid)
        self.last = exc


def exhausted(last: Exception | None, role: str, what: str) -> Exception:
    """The answer once every attempt failed: 429 with Retry-After (`Overloaded`) when the last
    worker said "not now", else the last failure as an explicit upstream error."""
    if last is not None and is_backpressure(last):
        return Overloaded(role)
    status = last.status if isinstance(last, LegFailed) else 502
    return UpstreamError(status, {"error": {
        "message": f"{what} failed on every attempt: {last}", "type": "UpstreamError",
        "param": None, "code": status}})


class LegFailed(Exception):
    """A worker-side failure worth a retry elsewhere."""

    def __init__(self, cause: str, detail: str, status: int = 502) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.status = status


def upstream_body(status: int, raw: bytes) -> dict[str, Any]:
    """A worker's error answer as an OpenAI error body (vLLM's own when it sent one)."""
    try:
        body = json.loads(raw)
        if isinstance(body, dict) and "error" in body:
            return body
    except ValueError:
        pass
    text = raw[:500].decode(errors="replace")
    return {"error": {"message": text or f"worker answered {status}",
                      "type": "UpstreamError", "param": None, "code": status}}
