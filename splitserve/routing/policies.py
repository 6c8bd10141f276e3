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
- `cache` (the router's default for P and D): `load`, with each worker's cached prefix of
  this prompt (`RouteRequest.cached`, the router's exact index) taken off what it costs.
  P: the prompt tokens it would still compute (prompt - `prefill_hit` x its cached prefix)
  plus the prefill tokens queued there, counted as `load` counts them; ties by open legs.
  D: `load`'s score less `decode_hit` x the fraction of the prompt it holds (a follow-up turn
  on the D that holds the conversation), so a full hit is worth `decode_hit` of KV fraction,
  or 16 x `decode_hit` open legs. Colocated: open requests less `colocated_hit` x the
  fraction held; ties in turn. Weights: `CacheWeights`. With nothing cached (a worker whose
  view is not synced, a request without ids, the simulator) each score is `load`'s, so
  `cache` then picks exactly as `load` does.
`power_of_two` and `least_loaded` compare the pool's queue (`queued`): P by queued prompt
tokens, D and colocated by open legs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CacheWeights:
    """How much a cached prefix counts in `cache`'s scores (1.0: what it saves, no more).
    `prefill_hit`: P, per cached token, against a prompt token queued or to compute.
    `decode_hit`: D, for the whole prompt cached, against `load`'s score (KV fraction +
    staging fraction + open legs / 16). `colocated_hit`: the same against open requests."""

    prefill_hit: float = 1.0
    decode_hit: float = 1.0
    colocated_hit: float = 1.0

    def __post_init__(self) -> None:
        if min(self.prefill_hit, self.decode_hit, self.colocated_hit) < 0:
            raise ValueError("cache weights must not be negative")


def prefill_cost(w: WorkerView, request: RouteRequest, hit_weight: float = 1.0
                 ) -> tuple[float, int]:
    """P's `cache` score: `prefill_score` less `hit_weight` x the prompt tokens `w` holds."""
    queued_tokens, legs = prefill_score(w, request.prompt_len)
    return (queued_tokens - hit_weight * request.cached_on(w.worker_id), legs)


def held_fraction(w: WorkerView, request: RouteRequest) -> float:
    """The fraction of the prompt `w` is known to hold."""
    n = request.prompt_len
    return request.cached_on(w.worker_id) / n if n else 0.0


class _Cached(_Base):
    """A `cache` policy: its weights are set by whoever makes it (`make_policy`)."""

    name = "cache"

    def __init__(self, pool: Pool, draws: Draws) -> None:
        super().__init__(pool, draws)
        self.weights = CacheWeights()


class CachePrefill(_Cached):
    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        hit = self.weights.prefill_hit
        return min(candidates, key=lambda w: prefill_cost(w, request, hit))


class CacheDecode(_Cached):
    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        hit = self.weights.decode_hit
        return min(candidates, key=lambda w: decode_score(w) - hit * held_fraction(w, request))


class CacheColocated(_Cached):
    def __init__(self, pool: Pool, draws: Draws) -> None:
        super().__init__(pool, draws)
        self._ties = RoundRobin(pool, draws)

    def pick(self, candidates: Sequence[W], request: RouteRequest) -> W:
        hit = self.weights.colocated_hit
        scores = [w.inflight - hit * held_fraction(w, request) for w in candidates]
        least = min(scores)
        return self._ties.pick([w for w, s in zip(candidates, scores, strict=True)
                                if s == least], request)


def _table(load: PolicyFactory, cache: PolicyFactory) -> Mapping[str, PolicyFactory]:
    return MappingProxyType({"cache": cache, "load": load, "round_robin": RoundRobin,
                             "random": Random, "power_of_two": PowerOfTwo,
                             "least_loaded": LeastLoaded})


# Every policy, by pool and name: what the router's flags and the simulator's config accept.
POLICIES: Mapping[Pool, Mapping[str, PolicyFactory]] = MappingProxyType({
    Pool.PREFILL: _table(LoadPrefill, CachePrefill),
    Pool.DECODE: _table(LoadDecode, CacheDecode),
    Pool.COLOCATED: _table(LoadColocated, CacheColocated),
})
DEFAULT_POLICY = "cache"  # P and D; the router's colocated pool: `load` (`COLOCATED_POLICY`)
COLOCATED_POLICY = "load"  # the unsplit path sends the request's bytes: it knows no token ids


def policy_names(pool: Pool) -> tuple[str, ...]:
    """The names `pool` accepts (argparse `choices`, config validation)."""
    return tuple(POLICIES[pool])


def make_policy(pool: Pool, name: str, draws: Draws | None = None,
                weights: CacheWeights | None = None) -> Policy:
    """A fresh instance of policy `name` for `pool` (`weights`: a `cache` policy's; default
    `CacheWeights()`); ValueError naming the choices."""
    factory = POLICIES[Pool(pool)].get(name)
    if factory is None:
        raise ValueError(f"{pool} policy must be one of {policy_names(Pool(pool))}, got {name!r}")
    policy = factory(Pool(pool), draws if draws is not None else RandomDraws())
    if weights is not None and isinstance(policy, _Cached):
        policy.weights = weights
    return policy
