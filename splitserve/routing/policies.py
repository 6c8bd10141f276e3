"""Routing policies: which worker of a pool takes a request. Pure code over `WorkerView`s, shared
by the router (`router.policy.Picker`) and the simulator (`sim.routing`), registered by name per
pool in `POLICIES`.

Contract of a `Policy` (the swap point):
- `pick(candidates, request)` returns one of `candidates`, which is never empty and holds only
  workers that may take the request (in rotation, under the queue limit, and for D with room
  in staging when any has: the caller filters; a policy never raises for load).
- It reads only the `WorkerView` signals and the `RouteRequest`; it never changes a worker.
- It may keep its own state (a cursor); one instance serves one pool of one router or run.
- Randomness comes only from the `Draws` it was made with, `draws_per_pick` draws per pick, so
  the simulator can draw them up front from its seeded generator.
- `load_blind`: its choice depends on neither the signals nor the request (the simulator may
  then make every choice of a run at its start).

The policies:
- `load`: P: fewest queued prompt tokens, counting the engine's waiting requests as that many
  more of this prompt, and this prompt itself; ties by open legs. D: lowest used KV fraction +
  used staging fraction + open legs / 16. Colocated: fewest open requests, ties in turn.
- `round_robin`: in turn over the candidates.
- `random`: uniformly at random.
- `power_of_two`: the less loaded of two drawn at random (with replacement; ties: the first).
- `least_loaded`: the least loaded (ties: the first).
`power_of_two` and `least_loaded` compare the pool's queue (`queued`): P by queued prompt
tokens, D and colocated by open legs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar, Protocol, TypeVar

from splitserve.common.vocab import Pool
from splitserve.routing.view import Draws, RandomDraws, RouteRequest, WorkerView

W = TypeVar("W", bound=WorkerView)


class Policy(Protocol):
    """One pool's choice of a worker per request (see the module docstring for the contract)."""

    name: ClassVar[str]
    load_blind: ClassVar[bool]
    draws_per_pick: ClassVar[int]

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W: ...


PolicyFactory = Callable[[Pool, Draws], Policy]


def queued(pool: Pool) -> Callable[[WorkerView], float]:
    """The queue `power_of_two` and `least_loaded` compare in `pool`."""
    if pool == Pool.PREFILL:
        return lambda w: w.inflight_prefill_tokens
    return lambda w: w.inflight


def prefill_score(w: WorkerView, prompt_tokens: int) -> tuple[float, int]:
    """P's `load` score: prompt tokens queued there (the engine's waiting requests counted as
    this prompt each), plus this prompt; ties by open legs."""
    return (w.inflight_prefill_tokens + w.waiting * prompt_tokens + prompt_tokens, w.inflight)


def decode_score(w: WorkerView) -> float:
    """D's `load` score: used KV fraction + used staging fraction + open legs / 16 (the open
    legs are the router's own count, current between health polls)."""
    staged = w.staged_bytes / w.staging_capacity_bytes if w.staging_capacity_bytes else 0.0
    return w.kv_usage + staged + w.inflight / 16


def fits_staging(w: WorkerView, kv_bytes: int) -> bool:
    """Whether D's staging area can hold `kv_bytes` more (always, without a known limit)."""
    if not w.staging_capacity_bytes:
        return True
    return w.staging_capacity_bytes - w.staged_bytes >= kv_bytes


class _Base:
    name: ClassVar[str]
    load_blind: ClassVar[bool] = False
    draws_per_pick: ClassVar[int] = 0

    def __init__(self, pool: Pool, draws: Draws) -> None:
        self.pool = pool
        self.draws = draws


class RoundRobin(_Base):
    name = "round_robin"
    load_blind = True

    def __init__(self, pool: Pool, draws: Draws) -> None:
        super().__init__(pool, draws)
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        return candidates[next(self._turn) % len(candidates)]


class Random(_Base):
    name = "random"
    load_blind = True
    draws_per_pick = 1

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        return candidates[self.draws.index(len(candidates))]


class PowerOfTwo(_Base):
    name = "power_of_two"
    draws_per_pick = 2

    def __init__(self, pool: Pool, draws: Draws) -> None:
        super().__init__(pool, draws)
        self._queued = queued(pool)

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        m = len(candidates)
        a, b = candidates[self.draws.index(m)], candidates[self.draws.index(m)]
        return a if self._queued(a) <= self._queued(b) else b


class LeastLoaded(_Base):
    name = "least_loaded"

    def __init__(self, pool: Pool, draws: Draws) -> None:
        super().__init__(pool, draws)
        self._queued = queued(pool)

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        return min(candidates, key=self._queued)


class LoadPrefill(_Base):
    name = "load"

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        n = request.prompt_len
        return min(candidates, key=lambda w: prefill_score(w, n))


class LoadDecode(_Base):
    name = "load"

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        return min(candidates, key=decode_score)


class LoadColocated(_Base):
    name = "load"

    def __init__(self, pool: Pool, draws: Draws) -> None:
        super().__init__(pool, draws)
        self._ties = RoundRobin(pool, draws)

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        least = min(w.inflight for w in candidates)
        return self._ties.pick([w for w in candidates if w.inflight == least], request)


def _table(load: PolicyFactory) -> Mapping[str, PolicyFactory]:
    return MappingProxyType({"load": load, "round_robin": RoundRobin, "random": Random,
                             "power_of_two": PowerOfTwo, "least_loaded": LeastLoaded})


# Every policy, by pool and name: what the router's flags and the simulator's config accept.
POLICIES: Mapping[Pool, Mapping[str, PolicyFactory]] = MappingProxyType({
    Pool.PREFILL: _table(LoadPrefill),
    Pool.DECODE: _table(LoadDecode),
    Pool.COLOCATED: _table(LoadColocated),
})
DEFAULT_POLICY = "load"


def policy_names(pool: Pool) -> tuple[str, ...]:
    """The names `pool` accepts (argparse `choices`, config validation)."""
    return tuple(POLICIES[pool])


def make_policy(pool: Pool, name: str, draws: Draws | None = None) -> Policy:
    """A fresh instance of policy `name` for `pool`; ValueError naming the choices."""
    factory = POLICIES[Pool(pool)].get(name)
    if factory is None:
        raise ValueError(f"{pool} policy must be one of {policy_names(Pool(pool))}, got {name!r}")
    return factory(Pool(pool), draws if draws is not None else RandomDraws())
