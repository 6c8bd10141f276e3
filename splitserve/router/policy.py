"""Choosing workers. Pure functions of the registry's view, plus a round-robin cursor per pool.

- P (`load`): fewest queued prompt tokens the router has in flight there, counting this
  request's own prompt, so a long prompt goes where it will wait least; ties by open legs.
- D (`load`): lowest score of used KV fraction + used staging fraction + open legs / 16 (the
  router's own count, current between health polls); a D whose staging area cannot hold this
  prompt's KV is skipped while any other can.
- Colocated: fewest open requests (plain load balancing).
- `round_robin`: in turn, skipping workers out of rotation.
- Queue limit: a worker with `max_per_worker` open legs takes no more; when every worker of a
  pool is at its limit the request is refused with `Overloaded` (the router answers 429 with
  `Retry-After`) — back-pressure, never counted as a failure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from splitserve.router.health import Worker


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


def prefill_score(w: Worker, prompt_tokens: int) -> tuple[float, int]:
    return (w.inflight_prefill_tokens + w.waiting * prompt_tokens + prompt_tokens, w.inflight)


def decode_score(w: Worker) -> float:
    staged = w.staged_bytes / w.staging_capacity_bytes if w.staging_capacity_bytes else 0.0
    return w.kv_usage + staged + w.inflight / 16


def fits_staging(w: Worker, kv_bytes: int) -> bool:
    if not w.staging_capacity_bytes:
        return True
    return w.staging_capacity_bytes - w.staged_bytes >= kv_bytes


class Picker:
    """Holds the round-robin cursors; everything else is read from the workers."""

    def __init__(self, prefill_policy: str, decode_policy: str,
                 max_per_worker: int | None = None) -> None:
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.max_per_worker = max_per_worker
        self._cursors: dict[str, itertools.count[int]] = {}

    def _with_room(self, role: str, candidates: Sequence[Worker]) -> Sequence[Worker]:
        if not candidates:
            raise NoWorker(role)
        if self.max_per_worker is None:
            return candidates
        room = [w for w in candidates if w.inflight < self.max_per_worker]
        if not room:
            raise Overloaded(role)
        return room

    def _round_robin(self, pool: str, candidates: Sequence[Worker]) -> Worker:
        cursor = self._cursors.setdefault(pool, itertools.count())
        return candidates[next(cursor) % len(candidates)]

    def prefill(self, candidates: Sequence[Worker], prompt_tokens: int) -> Worker:
        candidates = self._with_room("prefill", candidates)
        if self.prefill_policy == "round_robin":
            return self._round_robin("prefill", candidates)
        return min(candidates, key=lambda w: prefill_score(w, prompt_tokens))

    def decode(self, candidates: Sequence[Worker], kv_bytes: int = 0) -> Worker:
        candidates = self._with_room("decode", candidates)
        roomy = [w for w in candidates if fits_staging(w, kv_bytes)] or list(candidates)
        if self.decode_policy == "round_robin":
            return self._round_robin("decode", roomy)
        return min(roomy, key=decode_score)

    def colocated(self, candidates: Sequence[Worker]) -> Worker:
        candidates = self._with_room("colocated", candidates)
        least = min(w.inflight for w in candidates)
        return self._round_robin("colocated", [w for w in candidates if w.inflight == least])
