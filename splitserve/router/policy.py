"""Choosing workers: the router's side of the routing policies (`splitserve.routing`).

`Picker` holds one policy instance per pool (by the names in `RouterConfig`, with `cache`'s
weights; colocated: `load`, as the unsplit path knows no token ids) and applies, before any
policy, what is the router's and not a policy's:
- Queue limit: a worker with `max_per_worker` open legs takes no more; when every worker of a
  pool is at its limit the request is refused with `Overloaded` (the router answers 429 with
  `Retry-After`) — back-pressure, never counted as a failure. An empty pool is `NoWorker`.
- Staging fit (D): a D whose staging area cannot hold this prompt's KV is skipped while any
  other can.
The policies themselves (`cache`, `load`, `round_robin`, `random`, `power_of_two`,
`least_loaded`) are described in `splitserve.routing.policies`.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.vocab import Pool
from splitserve.router.worker import Worker
from splitserve.routing import (
    COLOCATED_POLICY,
    DEFAULT_POLICY,
    NO_REQUEST,
    CacheWeights,
    Draws,
    RandomDraws,
    RouteRequest,
    fits_staging,
    make_policy,
)


class NoWorker(Exception):
    """No worker of the needed role is in rotation."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no {role} worker is available")
        self.role = role


class Overloaded(NoWorker):
    """Every worker of the role is at its queue limit: back-pressure, answered with 429."""

    def __init__(self, role: str) -> None:
        Exception.__init__(self, f"every {role} worker is at its queue limit; retry later")
        self.role = role


class Picker:
    """One policy per pool (each keeps its own cursor or random source)."""

    def __init__(self, prefill_policy: str = DEFAULT_POLICY, decode_policy: str = DEFAULT_POLICY,
                 max_per_worker: int | None = None, colocated_policy: str = COLOCATED_POLICY,
                 draws: Draws | None = None, weights: CacheWeights | None = None) -> None:
        draws = draws if draws is not None else RandomDraws()
        self.policies = {
            Pool.PREFILL: make_policy(Pool.PREFILL, prefill_policy, draws, weights),
            Pool.DECODE: make_policy(Pool.DECODE, decode_policy, draws, weights),
            Pool.COLOCATED: make_policy(Pool.COLOCATED, colocated_policy, draws, weights)}
        self.max_per_worker = max_per_worker

    def _with_room(self, pool: Pool, candidates: Sequence[Worker]) -> Sequence[Worker]:
        if not candidates:
            raise NoWorker(pool.value)
        if self.max_per_worker is None:
            return candidates
        room = [w for w in candidates if w.inflight < self.max_per_worker]
        if not room:
            raise Overloaded(pool.value)
        return room

    def prefill(self, candidates: Sequence[Worker], request: RouteRequest) -> Worker:
        return self.policies[Pool.PREFILL].pick(self._with_room(Pool.PREFILL, candidates),
                                                request)

    def decode(self, candidates: Sequence[Worker], request: RouteRequest = NO_REQUEST
               ) -> Worker:
        candidates = self._with_room(Pool.DECODE, candidates)
        roomy = [w for w in candidates if fits_staging(w, request.kv_bytes_on(w.worker_id))
                 ] or list(candidates)
        return self.policies[Pool.DECODE].pick(roomy, request)

    def colocated(self, candidates: Sequence[Worker], request: RouteRequest = NO_REQUEST
                  ) -> Worker:
        return self.policies[Pool.COLOCATED].pick(
            self._with_room(Pool.COLOCATED, candidates), request)
