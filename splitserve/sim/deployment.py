"""What the simulator is asked to run (`SimConfig`) and what it returns (`SimOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from splitserve.common.vocab import Pool
from splitserve.routing import policy_names
from splitserve.routing.prefix import LOCAL_PREFILL_MAX_TOKENS

Mode = Literal["disagg", "colocated", "chunked"]
# the router's policies (`splitserve.routing.POLICIES`), which the simulator runs by name.
# `cache` sees the workers' prefix caches when the workload has prefix identity
# (`SimWorkload.blocks`); without it nothing is cached and `cache` picks as `load` does.
Policy = Literal["cache", "load", "round_robin", "random", "power_of_two", "least_loaded"]
Connector = Literal["splitserve", "nixl", "mooncake"]
MODES: tuple[str, ...] = ("disagg", "colocated", "chunked")
CONNECTORS: tuple[str, ...] = ("splitserve", "nixl", "mooncake")
POLICIES: tuple[str, ...] = policy_names(Pool.PREFILL)


@dataclass(frozen=True)
class SimConfig:
    """A deployment to simulate. `colocated` runs whole prompts in one step; `chunked` splits
    them to fit `token_budget` (vLLM's chunked prefill). `n_prefill`/`n_decode` are used by
    `disagg`, `n_workers` by the colocated modes.

    `connector` (disagg): `splitserve` pushes the KV layer by layer while P prefills (`overlap`)
    and D computes t2 in its first step; `nixl` (vLLM's NixlConnector) has D pull P's whole
    blocks after P's prefill, from D's next step once its leg reached D's scheduler (t1 + router
    hop + `pull_request_s`), and D's first step replays t1, so t2 comes with its second step;
    `mooncake` (vLLM's MooncakeConnector) sends D's leg with P's, so P sends its whole blocks
    the moment its prefill ends and D's first step after they are in replays t1.
    `transport` names the profile's link each uses.

    Prefix caching (a workload with `blocks`): `prefix_caching` gives every engine its prefix
    cache (`sim.prefixcache`); `cache_aware` gives the router its index of them, which sees
    each block cached or evicted `index_lag_s` after it happened (the router learns them from
    the workers' KV events; 0: exactly current): the policies see each worker's cached
    prefix, a request whose D holds all but at most `local_prefill_max_tokens` of the prompt
    runs whole on D (prefill on D; 0: never), and P sends D only the KV it lacks (a delta
    transfer). Cache-blind (`cache_aware` False), the engines still reuse what they hold, but
    routing is by load alone and every transfer is whole, as the router runs without its
    index."""

    mode: Mode = "disagg"
    n_prefill: int = 1
    n_decode: int = 1
    n_workers: int = 2
    token_budget: int | None = None  # None: the profile's
    p_policy: Policy = "power_of_two"
    d_policy: Policy = "power_of_two"
    transport: str = "tcp"
    connector: Connector = "splitserve"
    overlap: bool = True  # splitserve: layer-wise KV push during the prefill
    pull_request_s: float = 0.0  # nixl: D's leg from its arrival at D to its scheduler
    shared_link: bool = False  # one link for the whole cluster instead of one per P-worker
    # the client → router → worker hop: every request's first token pays it once (split: on
    # t1, and D's leg joins a hop after t1; computed whole: it reaches its worker a hop late)
    router_hop_s: float = 0.0
    split_costs: bool = True  # disagg: apply the profile's measured `split` costs, if any
    prefix_caching: bool = True  # the engines' prefix caches (with a workload's `blocks`)
    cache_aware: bool = True  # the router's index of them: cached prefixes, prefill on D, deltas
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # prefill on D (0: never)
    index_lag_s: float = 0.0  # the router's index sees a cache change this long after it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {CONNECTORS}, got {self.connector!r}")
        pools = {"p_policy": Pool.PREFILL if self.mode == "disagg" else Pool.COLOCATED,
                 "d_policy": Pool.DECODE}
        for name, pool in pools.items():
            if getattr(self, name) not in policy_names(pool):
                raise ValueError(f"{name} must be one of {policy_names(pool)}")
        if self.mode == "disagg" and (self.n_prefill < 1 or self.n_decode < 1):
            raise ValueError("disaggregated serving needs n_prefill >= 1 and n_decode >= 1")
        if self.mode != "disagg" and self.n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError("token_budget must be >= 1")
        if self.router_hop_s < 0 or self.pull_request_s < 0 or self.index_lag_s < 0:
            raise ValueError("router_hop_s, pull_request_s and index_lag_s must be >= 0")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must not be negative (0 turns it off)")

    @property
    def workers(self) -> int:
        return self.n_prefill + self.n_decode if self.mode == "disagg" else self.n_workers


# a run of decode steps: (alpha, beta, steps, batch, new, t0, worker, step0), as SimOutcome's seg_*
Segment = tuple[float, float, int, int, int, float, int, int]


@dataclass(frozen=True, eq=False)
class SimOutcome:
    """Per-request times (s, NaN where not reached) and the pooled decode-step record for ITL:
    segment i has `seg_k[i]` steps lasting `seg_alpha[i] + seg_beta[i]·j`, each step yielding
    `seg_batch[i]` inter-token gaps, except the first, which yields `seg_batch - seg_new`."""

    arrivals: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    first_token: np.ndarray
    second_token: np.ndarray
    finish: np.ndarray
    failed: np.ndarray
    seg_alpha: np.ndarray
    seg_beta: np.ndarray
    seg_k: np.ndarray
    seg_batch: np.ndarray
    seg_new: np.ndarray
    seg_t0: np.ndarray  # when the segment's first step started
    seg_worker: np.ndarray
    seg_step0: np.ndarray  # the worker's step count before the segment
    decode_worker: np.ndarray  # per request: the worker that decoded it (-1: none)
    join_step: np.ndarray  # per request: that worker's step count when it joined
    # per request split across a KV link (else NaN): the transfer's span (push: its first
    # bytes moving on the link → all at D; NIXL: the READ posted → in; Mooncake: P's send →
    # in), as the benchmark's BEGIN → END, and its exposed tail (P's prefill end → all at D)
    kv_transfer_s: np.ndarray
    kv_tail_s: np.ndarray
    events: int
    # per request, with prefix caching (else None): the prompt tokens its computing engine
    # reused (P's for a split request, D's for one prefilled on D), whether it ran whole on
    # D, and the KV bytes that crossed to D
    prefill_busy_s: float = 0.0  # engine-seconds of steps that prefilled, all workers
    prefill_gpu_s: float = 0.0  # the same, each worker's seconds times its GPUs (its TP)
    cached_tokens: np.ndarray | None = None
    local: np.ndarray | None = None
    kv_bytes: np.ndarray | None = None
    # the step-gap jitter (seconds added, weight per mille) ITL carries (the profile's, or its
    # split costs' through the overlay)
    gap_jitter_s: tuple[tuple[float, int], ...] = ()


def segment_arrays(segs: list[Segment]) -> dict[str, np.ndarray]:
    """`SimOutcome`'s seg_* fields from a run's segment records."""
    a = np.asarray(segs, dtype=np.float64).reshape(-1, 8)
    ints = ("seg_k", "seg_batch", "seg_new", "seg_worker", "seg_step0")
    names = ("seg_alpha", "seg_beta", "seg_k", "seg_batch", "seg_new", "seg_t0", "seg_worker",
             "seg_step0")
    return {n: a[:, i].astype(np.int64) if n in ints else a[:, i] for i, n in enumerate(names)}
