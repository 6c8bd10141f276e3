"""The deployment's directory: one named Ray actor that every replica and the router host talk
to. It is the Ray-side source of truth the router's registry follows.

Contract:
- A replica `register`s once its worker answers `/health`, and `drain`s before it stops; every
  router host takes a draining (or vanished) worker out of its router and then calls
  `released`; the draining replica waits until every live router host has.
- Router hosts (one per router) are known by their router's URL: each `router_report`s its
  open legs per worker every round, which is also its proof of life; one silent for
  `ROUTER_STALE_S` no longer counts (its load, its peers' list, the drains it holds).
- `snapshot()` lists only live workers: an entry whose replica actor no longer exists (its
  process or its node died) is dropped there, together with its cores; so are the cores of a
  replica that died before it registered. A replica whose start fails deregisters itself.
- The deployment token and API key live here, set by the driver with `set_secrets` and read
  by replicas with `secrets()`: actor method calls, never argv, `runtime_env` or anything Ray's
  dashboard shows.
- Cores are claimed per machine (node IP), not per Ray node: logical nodes of one machine share
  its cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# the named actors alive on the cluster, and the nodes it declared dead
Liveness = Callable[[], tuple[set[str], set[str]]]


def ray_liveness() -> tuple[set[str], set[str]]:
    import ray

    return ({a["name"] for a in ray.util.list_named_actors(all_namespaces=True)},
            {n["NodeID"] for n in ray.nodes() if not n["Alive"]})

ROUTER_STALE_S = 5.0  # a router host silent this long is gone: drains stop waiting for it


@dataclass
class Entry:
    """One worker as Ray placed it."""

    replica: str  # the Serve replica's actor name
    kind: str  # prefill, decode or colocated
    url: str
    node_id: str
    node_ip: str
    cores: tuple[int, ...]
    draining: bool = False
    released_by: frozenset[str] = frozenset()  # the routers that let it go
    registered_at: float = 0.0


def replica_alive(name: str, alive_names: set[str], dead_nodes: set[str], entry: Entry) -> bool:
    return name in alive_names and entry.node_id not in dead_nodes


class WorkerDirectory:
    """Made a Ray actor by the driver (`ray.remote(WorkerDirectory)`); methods run one at a time."""

    def __init__(self, liveness: Liveness = ray_liveness) -> None:
        self._liveness = liveness  # what `prune` is told, when a reader needs the truth now
        self._token: str | None = None
        self._api_key: str | None = None
        self._entries: dict[str, Entry] = {}
        self._claims: dict[str, dict[str, tuple[int, ...]]] = {}  # node_ip -> replica -> cores
        # router URL -> (its open legs by worker URL, when it last reported)
        self._routers: dict[str, tuple[dict[str, dict[str, float]], float]] = {}
        self._log: list[dict[str, Any]] = []  # (time, kind, replicas) after every change

    # --- secrets ------------------------------------------------------------------------------
    def set_secrets(self, token: str, api_key: str | None) -> None:
        self._token, self._api_key = token, api_key

    def secrets(self) -> tuple[str | None, str | None]:
        return self._token, self._api_key

    # --- cores --------------------------------------------------------------------------------
    def claim_cores(self, node_ip: str, available: list[int], n: int, replica: str
                    ) -> tuple[int, ...]:
        """The `n` least-claimed of `available` on this machine (shared once all are taken)."""
        claims = self._claims.setdefault(node_ip, {})
        use = {c: 0 for c in available}
        for cores in claims.values():
            for c in cores:
                if c in use:
                    use[c] += 1
        chosen = tuple(sorted(sorted(use, key=lambda c: (use[c], c))[:max(1, n)]))
        claims[replica] = chosen
        return chosen

    def placed(self) -> list[str]:
        """The replicas (Serve's full ids) on a node now: each claims its cores first thing and
        gives them back when it deregisters; one that died (its node lost, or killed) does
        not count."""
        self._prune_now()
        return sorted(r for claims in self._claims.values() for r in claims)

    def _release_cores(self, replica: str) -> None:
        for claims in self._claims.values():
            claims.pop(replica, None)

    # --- membership ---------------------------------------------------------------------------
    def register(self, entry: dict[str, Any]) -> None:
        e = Entry(**entry)
        e.registered_at = time.time()
        self._entries[e.replica] = e
        self._note()

    def drain(self, replica: str) -> None:
        if replica in self._entries:
            self._entries[replica].draining = True
            self._note()

    def released(self, replica: str, router: str) -> None:
        """The router at URL `router` no longer routes to `replica`'s worker."""
        if replica in self._entries:
            e = self._entries[replica]
            e.released_by = e.released_by | {router}

    def drained(self, replica: str) -> bool:
        """Whether a draining replica may stop: every live router let it go (or none is left)."""
        entry = self._entries.get(replica)
        return entry is None or set(self.routers()) <= entry.released_by

    def deregister(self, replica: str) -> None:
        self._entries.pop(replica, None)
        self._release_cores(replica)
        self._note()

    def snapshot(self) -> list[dict[str, Any]]:

        self._prune_now()
        return [asdict(e) for e in self._entries.values()]

    def _prune_now(self) -> None:
        self.prune(*self._liveness())

    def prune(self, alive: set[str], dead_nodes: set[str]) -> None:
        """Forget the replicas that are not among the `alive` actor names or sit on one of
        `dead_nodes`: their entries and their core claims (registered or not)."""
        gone = [r for r, e in self._entries.items()
                if not replica_alive(r, alive, dead_nodes, e)]
        for replica in gone:
            self.deregister(replica)
        for claims in self._claims.values():  # replicas lost before they registered
            for replica in [r for r in claims if r not in alive]:
                del claims[replica]

    def _note(self) -> None:
        counts: dict[str, int] = {}
        for e in self._entries.values():
            if not e.draining:
                counts[e.kind] = counts.get(e.kind, 0) + 1
        self._log.append({"t": time.time(), **counts})

    def history(self) -> list[dict[str, Any]]:
        """Routable workers per pool after every membership change (for timelines)."""
        return list(self._log)

    # --- the router's view of load, for the autoscaling signals -------------------------------
    def router_report(self, router: str, loads: dict[str, dict[str, float]]) -> None:
        """The router at URL `router`: its open legs (`inflight`, `inflight_prefill_tokens`)
        by worker URL, now."""
        self._routers[router] = (loads, time.time())

    def router_stopped(self, router: str | None = None) -> None:
        """That router (None: every one) is gone: its load and the drains it held are dropped."""
        for url in [router] if router is not None else list(self._routers):
            self._routers.pop(url, None)

    def routers(self) -> list[str]:
        """The URLs of the routers that reported within `ROUTER_STALE_S`."""
        now = time.time()
        return [u for u, (_, seen) in self._routers.items() if now - seen <= ROUTER_STALE_S]

    def router_load(self, url: str) -> dict[str, float]:
        """The worker at `url`'s open legs, summed over the live routers."""
        out: dict[str, float] = {}
        for router in self.routers():
            for key, value in self._routers[router][0].get(url, {}).items():
                out[key] = out.get(key, 0.0) + value
        return out
