"""What a routing policy may know: the load signals of a worker (`WorkerView`) and the request
being routed (`RouteRequest`), plus the random source of the policies that draw (`Draws`).

The router's `router.worker.Worker` and the simulator's `sim.routing.SimWorkerView` both satisfy
`WorkerView`, so one policy runs in both. Nothing here imports the router or the simulator.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class WorkerView(Protocol):
    """The load signals of one worker, as a policy reads them. Read-only to a policy.

    The router's own accounting (current at every pick):
    - `inflight`: legs the router has open on the worker (a D counts the leg reserved for a
      request from the moment D is chosen, before its P leg ends);
    - `inflight_prefill_tokens`: the prompt tokens of those legs still being prefilled there
      (P: every open P leg's prompt; D and colocated: 0).

    What the engine reports (the router: at the last health check, up to one interval old):
    - `waiting`, `running`: vLLM's waiting and running requests;
    - `kv_usage`: vLLM's KV cache usage, 0..1;
    - `staged_bytes`, `staging_capacity_bytes`: KV staged on a splitserve-connector D ahead of
      its decode legs, and the staging area's size (0: no staging limit known).
    A signal the worker has not reported yet reads 0.

    `worker_id`: the worker's name in `RouteRequest.cached` (the router: its URL; one engine
    serving in two pools has one id).
    """

    @property
    def worker_id(self) -> str: ...

    @property
    def inflight(self) -> int: ...

    @property
    def inflight_prefill_tokens(self) -> int: ...

    @property
    def waiting(self) -> float: ...

    @property
    def running(self) -> float: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def staged_bytes(self) -> float: ...

    @property
    def staging_capacity_bytes(self) -> float: ...


@dataclass(frozen=True)
class RouteRequest:
    """The request a worker is picked for.

    `token_ids`: the prompt exactly as P will receive it (the router tokenizes string prompts as
    the engine does and sends these ids on; chat is rendered to ids); None when they are not
    known as the cache index keys them (no tokenizer; ids the engine truncates, or salts with a
    `cache_salt`: the router's `Legs.indexed_ids`; the simulator, whose requests have lengths
    only).
    `prompt_len`: its length in tokens (`len(token_ids)` when they are known, else an estimate).
    `kv_bytes`: the KV the prompt takes on D (0: unknown; the staging fit is then skipped).
    `cached`: by `WorkerView.worker_id`, the prompt tokens each worker's prefix cache is known
    to hold (the router's exact index: a multiple of the worker's block size; of a prompt held
    whole the engine still computes the last token, one block more: the router caps it for
    P's reuse it reports and for prefill on D, policies score what is held); a worker left
    out is not known (its view is not synced) and is scored as holding nothing, as `load`
    scores it. None: nothing is known (no index, no ids, the simulator)."""

    prompt_len: int = 0
    token_ids: Sequence[int] | None = None
    kv_bytes: int = 0
    cached: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0 or self.kv_bytes < 0:
            raise ValueError("prompt_len and kv_bytes must not be negative")
        if self.token_ids is not None and len(self.token_ids) != self.prompt_len:
            raise ValueError(f"prompt_len {self.prompt_len} differs from the "
                             f"{len(self.token_ids)} token ids")

    @classmethod
    def of_ids(cls, token_ids: Sequence[int], kv_bytes_per_token: int = 0,
               cached: Mapping[str, int] | None = None) -> RouteRequest:
        """A request whose prompt ids are known."""
        return cls(len(token_ids), token_ids, len(token_ids) * kv_bytes_per_token, cached)

    def cached_on(self, worker_id: str) -> int:
        """The prompt tokens `worker_id` is known to hold (0: none, or not known)."""
        if self.cached is None:
            return 0
        return min(self.cached.get(worker_id, 0), self.prompt_len)

    def kv_bytes_on(self, worker_id: str) -> int:
        """The KV a transfer to D `worker_id` stages: the prompt's, less the prefix D is known
        to hold (a delta transfer skips it)."""
        if not self.prompt_len:
            return self.kv_bytes
        return self.kv_bytes * (self.prompt_len - self.cached_on(worker_id)) // self.prompt_len


NO_REQUEST = RouteRequest()  # for picks that concern no prompt (a resumed decode leg)


class Draws(Protocol):
    """A policy's source of random choices: `index(n)` is uniform in [0, n). The router uses
    `RandomDraws`; the simulator feeds the draws it made up front from its seeded generator."""

    def index(self, n: int) -> int: ...


class RandomDraws:
    """`Draws` from a private `random.Random` (seeded: reproducible; None: from the OS)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def index(self, n: int) -> int:
        return self._rng.randrange(n)
