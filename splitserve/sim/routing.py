"""The simulated router's choice of a worker per request: the router's own policies
(`splitserve.routing`, by the same names), run over `SimWorkerView`s of the simulator's workers.

The simulator calls `pick_all` once per pool at the start of a run and `pick` on each arrival.
Randomness comes from the run's seeded generator, drawn up front in the order the simulator
always drew it (its two `power_of_two` columns, then `random`'s), so a run is reproducible.
A load-blind policy (`round_robin`, `random`) makes every choice at the start, one per request
in arrival order: as in the router, whose D cursor moves for every request (it picks D before it
knows whether the request ends at t1).

The simulator's workers are always in rotation, have no queue limit, and no staging limit
(`staging_capacity_bytes` 0: the router's staging filter keeps every D), so a pick sees the
whole pool. With prefix caches and the router's index (`SimConfig.cache_aware`) a pick sees
each worker's cached prefix of the prompt (`RouteRequest.cached`, from `sim.prefixcache`);
otherwise nothing is cached and `cache` picks exactly as `load` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from splitserve.common.vocab import Pool
from splitserve.routing import POLICIES, Policy, RouteRequest
from splitserve.routing.prefix import prefill_on_d, reusable
from splitserve.sim.deployment import SimConfig
from splitserve.sim.prefixcache import PrefixCaches
from splitserve.sim.workerstate import COLOCATED, DECODE, PREFILL, Limits, Worker

POOL_OF = {PREFILL: Pool.PREFILL, DECODE: Pool.DECODE, COLOCATED: Pool.COLOCATED}


class SimWorkerView:
    """A simulated worker as a policy sees it (`routing.WorkerView`), exactly current:

    - `inflight`: D and colocated: the requests assigned to it and not finished (its `load`);
      P: the prompts queued on it, not prefilled yet;
    - `inflight_prefill_tokens`: P: their prompt tokens (its `load`); else 0;
    - `waiting`: requests not started (P: queued behind the one prefilling; D: legs waiting
      for KV room or a batch slot); `running`: its batch; `kv_usage`: KV tokens held over
      capacity; no staging."""

    __slots__ = ("worker", "index", "kv_capacity")

    staged_bytes = 0.0
    staging_capacity_bytes = 0.0

    def __init__(self, worker: Worker, index: int, kv_capacity: int) -> None:
        self.worker, self.index, self.kv_capacity = worker, index, kv_capacity

    @property
    def worker_id(self) -> str:
        return str(self.index)

    @property
    def inflight(self) -> int:
        w = self.worker
        return len(w.queue) if w.role == PREFILL else w.load

    @property
    def inflight_prefill_tokens(self) -> int:
        w = self.worker
        return w.load if w.role == PREFILL else 0

    @property
    def waiting(self) -> float:
        w = self.worker
        return float(len(w.waiting) + max(len(w.queue) - 1, 0))

    @property
    def running(self) -> float:
        return float(self.worker.batch)

    @property
    def kv_usage(self) -> float:
        return self.worker.kv_used / self.kv_capacity if self.kv_capacity else 0.0


class PreDrawn:
    """`routing.Draws` over columns drawn up front: request i's k-th draw is `columns[k][i]`."""

    def __init__(self, columns: list[list[int]]) -> None:
        self.columns, self.i, self.k = columns, 0, 0

    def at(self, i: int) -> None:
        self.i, self.k = i, 0

    def index(self, n: int) -> int:
        value = self.columns[self.k][self.i]
        self.k += 1
        return value


@dataclass
class Choices:
    """One pool's routing in one run: its policy, and the choices made up front (load-blind)."""

    policy: Policy
    views: list[SimWorkerView]
    draws: PreDrawn
    drawn: list[int] | None
    prompt_lens: list[int]


def pick_all(rng: np.random.Generator, pool: list[Worker], policy: str, n: int, *,
             prompt_lens: list[int], kv_capacity: int = 0) -> Choices:
    """Set up `pool`'s routing for a run of `n` requests (`prompt_lens`: theirs); a load-blind
    policy's choices are all made here."""
    m = len(pool)
    kind = POOL_OF[pool[0].role]
    factory = POLICIES[kind].get(policy)
    if factory is None:
        raise ValueError(f"no {kind} policy {policy!r}; known: {tuple(POLICIES[kind])}")
    draws = PreDrawn([])
    chosen = factory(kind, draws)
    views = [SimWorkerView(w, j, kv_capacity) for j, w in enumerate(pool)]
    if not chosen.load_blind:
        return Choices(chosen, views, draws, None, prompt_lens)
    draws.columns = [rng.integers(0, m, size=n).tolist() for _ in range(chosen.draws_per_pick)]
    nothing = RouteRequest()
    drawn = []
    for i in range(n):
        draws.at(i)
        drawn.append(chosen.pick(views, nothing).index)
    return Choices(chosen, views, draws, drawn, prompt_lens)


def pick(pool: list[Worker], policy: str, pre: Choices, i: int, two: list[list[int]],
         cached: Mapping[str, int] | None = None) -> int:
    """Request i's worker (an index into `pool`): made up front, or by the policy now over the
    pool's current state (`two`: the run's two columns of draws, for `power_of_two`;
    `cached`: the router index's prompt tokens held per worker of the pool, by its number)."""
    if pre.drawn is not None:
        return pre.drawn[i]
    pre.draws.columns = two
    pre.draws.at(i)
    return pre.policy.pick(pre.views, RouteRequest(pre.prompt_lens[i], cached=cached)).index


@dataclass(frozen=True)
class Route:
    """Where one request goes: `p` (P or colocated worker; -1 when prefilled on D), `d` (D;
    -1: none), `local` (prefill on D), `d_reused` (the prompt tokens D holds: P sends the rest),
    `p_charged` (the prompt tokens it queues on P: those P computes)."""

    p: int
    d: int = -1
    local: bool = False
    d_reused: int = 0
    p_charged: int = 0


class SimRouter:
    """The router of a simulated run, deciding as splitserve's router does (`router.flow`):
    D first, by its policy over each D's cached prefix; a D that holds all but
    `local_prefill_max_tokens` of the prompt runs it whole (`routing.prefix.prefill_on_d`);
    else P by its policy, charged only the prompt tokens it computes, and D gets only the KV it
    lacks. `index`: the caches as the router's index sees them (None: a cache-blind router)."""

    def __init__(self, rng: np.random.Generator, cfg: SimConfig, P: list[Worker],
                 D: list[Worker], prompt_lens: list[int], limits: list[Limits],
                 index: PrefixCaches | None) -> None:
        n, npw = len(prompt_lens), len(P)
        self.cfg, self.P, self.D, self.prompt_lens, self.index = cfg, P, D, prompt_lens, index
        self.two_p = [rng.integers(0, npw, size=n).tolist() for _ in range(2)]
        self.pre_p = pick_all(rng, P, cfg.p_policy, n, prompt_lens=prompt_lens,
                              kv_capacity=limits[0].kv_capacity)
        if D:
            self.two_d = [rng.integers(0, len(D), size=n).tolist() for _ in range(2)]
            self.pre_d = pick_all(rng, D, cfg.d_policy, n, prompt_lens=prompt_lens,
                                  kv_capacity=limits[npw].kv_capacity)

    def _reused(self, cached: Mapping[str, int] | None, worker: int, r: int) -> int:
        if not cached or self.index is None:
            return 0
        return reusable(cached.get(str(worker), 0), self.prompt_lens[r],
                        self.index.block_tokens)

    def route(self, r: int, needs_d: bool) -> Route:
        """Request r's route on its arrival (`needs_d`: it decodes past its first token)."""
        index, n, npw = self.index, self.prompt_lens[r], len(self.P)
        d, d_reused = -1, 0
        if needs_d:
            cached = index.cached_on(r, npw, len(self.D)) if index else None
            d = pick(self.D, self.cfg.d_policy, self.pre_d, r, self.two_d, cached)
            d_reused = self._reused(cached, d, r)
            if prefill_on_d(d_reused, n, self.cfg.local_prefill_max_tokens):
                return Route(-1, d, local=True, d_reused=d_reused)
        cached = index.cached_on(r, 0, npw) if index else None
        p = pick(self.P, self.cfg.p_policy, self.pre_p, r, self.two_p, cached)
        return Route(p, d, d_reused=d_reused, p_charged=n - self._reused(cached, p, r))
