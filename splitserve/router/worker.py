"""One worker as the router sees it, in four parts, each with one writer:

- `Identity` (the registry: `add`, and the health loop's reads of `/splitserve/info`): where the
  worker is, the pool it serves in, the node it runs on, and what it said it is (`WorkerInfo`;
  None until read, and for a plain vLLM worker, which has no such route: `plain`).
- `Health` (the registry's breaker methods): the circuit breaker over consecutive outcomes.
- `Load` (the health loop): the engine's last `WorkerLoad` and the connector's staging.
- `Accounting` (the request path: `acquire`/`release`): the router's own open legs.
- `PeerShare` (`router.peers`): the open legs the other routers in front of it last reported.

Invariants:
- A worker takes new requests only while `routable` (healthy, not draining).
- `accounting.inflight` counts the router's own open legs on a worker; `drained` is set exactly
  while it is zero, so a removal can wait for it and lose no request. The policies' `inflight`
  adds the peers' share (`PeerShare`) to it.
- Mutated only on the router's event loop. The `WorkerView` signals a policy reads
  (`splitserve.routing.view`) are read-only properties over these parts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.load import LOAD_PATH
from splitserve.common.vocab import Connector, Pool
from splitserve.common.wire import WorkerInfo, WorkerLoad


@dataclass
class Identity:
    """Where the worker is and what it said it is."""

    url: str
    pool: Pool
    node: str | None = None  # where it runs, when the launcher knows (Ray: the node id)
    info: WorkerInfo | None = None  # GET /splitserve/info, once read
    plain: bool = False  # it answered 404 there: plain vLLM, no KV endpoint
    stale: bool = True  # read `info` again at the next good check (`registry`: the restart rule)

    @property
    def connector(self) -> Connector | None:
        """The connector it advertises; None for a plain vLLM worker or one not read yet."""
        return None if self.info is None else self.info.connector


@dataclass
class Health:
    """The circuit breaker: consecutive good checks and failures, the last error."""

    healthy: bool = False
    successes: int = 0
    failures: int = 0
    last_error: str | None = None
    checked_at: float = 0.0  # monotonic time of the last check; 0: never checked


@dataclass(frozen=True)
class Staging:
    """A splitserve-connector D's staging area (`ConnectorState`), as the policies read it."""

    staged_bytes: int = 0
    capacity_bytes: int = 0


@dataclass
class Load:
    """What the worker last reported, and from where."""

    engine: WorkerLoad = field(default_factory=WorkerLoad)
    staging: Staging = field(default_factory=Staging)
    # the splitserve worker's light route; "/metrics" once the worker answered 404 (plain vLLM)
    path: str = LOAD_PATH


@dataclass
class Accounting:
    """The router's own open legs on the worker."""

    inflight: int = 0
    inflight_prefill_tokens: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.inflight == 0:
            self.drained.set()


@dataclass(frozen=True)
class PeerShare:
    """The other routers' open legs on the worker, summed (`router.peers`; 0 without peers)."""

    inflight: int = 0
    inflight_prefill_tokens: int = 0


class Worker:
    """One worker: its four parts, `routable`, the leg accounting, and its `/workers` view."""

    def __init__(self, url: str, pool: Pool | str, node: str | None = None) -> None:
        self.identity = Identity(url.rstrip("/"), Pool(pool), node)
        self.health = Health()
        self.load = Load()
        self.accounting = Accounting()
        self.peers = PeerShare()
        self.draining = False  # the operator's: no new requests, open legs finish

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, {self.pool.value!r})"

    @property
    def url(self) -> str:
        return self.identity.url

    @property
    def pool(self) -> Pool:
        return self.identity.pool

    @property
    def info(self) -> WorkerInfo | None:
        return self.identity.info

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def routable(self) -> bool:
        return self.health.healthy and not self.draining

    # --- the WorkerView signals (splitserve.routing.view) -------------------------------------
    @property
    def worker_id(self) -> str:
        """Its name in `RouteRequest.cached` and the cache index: its URL (one engine)."""
        return self.identity.url

    @property
    def inflight(self) -> int:
        """Open legs on the worker: this router's and its peers'."""
        return self.accounting.inflight + self.peers.inflight

    @property
    def inflight_prefill_tokens(self) -> int:
        return self.accounting.inflight_prefill_tokens + self.peers.inflight_prefill_tokens

    @property
    def waiting(self) -> float:
        return self.load.engine.waiting or 0.0

    @property
    def running(self) -> float:
        return self.load.engine.running or 0.0

    @property
    def kv_usage(self) -> float:
        return self.load.engine.kv_usage or 0.0

    @property
    def staged_bytes(self) -> float:
        return float(self.load.staging.staged_bytes)

    @property
    def staging_capacity_bytes(self) -> float:
        return float(self.load.staging.capacity_bytes)

    # --- accounting ---------------------------------------------------------------------------
    @property
    def drained(self) -> asyncio.Event:
        return self.accounting.drained

    def acquire(self, prompt_tokens: int = 0) -> None:
        """One more open leg (with `prompt_tokens` still to prefill, on P)."""
        acc = self.accounting
        acc.inflight += 1
        acc.inflight_prefill_tokens += prompt_tokens
        acc.drained.clear()

    def release(self, prompt_tokens: int = 0) -> None:
        """That leg ended: the exact counterpart of one `acquire`."""
        acc = self.accounting
        acc.inflight -= 1
        acc.inflight_prefill_tokens -= prompt_tokens
        if acc.inflight == 0:
            acc.drained.set()

    def describe(self, kv_endpoint: dict[str, Any] | None = None) -> dict[str, Any]:
        """The worker in `GET /workers` (and the admin answers); `kv_endpoint` as the leg
        protocol of its connector gives it (`legs.LegProtocols.endpoint`)."""
        h = self.health
        return {"url": self.url, "role": self.pool.value, "node": self.identity.node,
                "healthy": h.healthy, "draining": self.draining,
                "inflight": self.accounting.inflight,
                "inflight_prefill_tokens": self.accounting.inflight_prefill_tokens,
                "peer_inflight": self.peers.inflight,
                "peer_inflight_prefill_tokens": self.peers.inflight_prefill_tokens,
                "kv_usage": self.kv_usage, "running": self.running, "waiting": self.waiting,
                "staged_bytes": self.staged_bytes,
                "staging_capacity_bytes": self.staging_capacity_bytes,
                "kv_endpoint": kv_endpoint, "last_error": h.last_error,
                "checked_age_s": round(time.monotonic() - h.checked_at, 3)
                if h.checked_at else None}
