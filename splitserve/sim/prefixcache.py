"""The simulated workers' prefix caches, and the router's exact index over them.

Each worker's cache holds prefix blocks by key (`SimWorkload.blocks`: a key names a whole prefix
up to its block), as vLLM's prefix cache holds KV blocks:
- a block is *pinned* while a request on that worker uses it (its hit, or the blocks it computed
  or received, until the worker frees that request's KV), and never evicted while pinned;
- an unpinned block stays cached in the worker's free KV memory, and is evicted least recently
  used first when that memory is needed: the unpinned blocks never exceed the worker's capacity
  (`capacity_blocks`) less the blocks its requests hold (`trim`, from its KV tokens in use);
- only full blocks are cached (a prompt's partial last block is computed, never stored).

A request's hit on a worker is its leading run of blocks that worker holds, in tokens, reused as
`routing.prefix.reusable` says (the engine computes at least the last prompt token). The index
(`cached_on`) answers what the router's index answers: per worker of a pool, the prompt tokens of
a request that worker holds. With `lag_s` 0 it is exactly current; else it sees each block cached
or evicted `lag_s` after it happened, as the router's index learns them from the workers' KV
event streams (the simulator sets `now` to each event's time before it changes a cache).

Contract: `pin`, `store` and `release` are called once per (worker, request) in that order of
life: `pin` when its prefill starts there (its hit), `store` when the worker holds the request's
full blocks (P and colocated: the prefill ended; D: the decode leg's KV arrived), `release` when
the worker frees the request's KV. A request released without `store` unpins its hit only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from splitserve.routing.prefix import reusable


class WorkerCache:
    """One worker's blocks: `pinned` (key -> requests using it), `lru` (unpinned, oldest first)."""

    __slots__ = ("capacity_blocks", "pinned", "lru", "held")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.pinned: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.held: dict[int, int] = {}  # request -> its leading blocks pinned here

    def __contains__(self, key: int) -> bool:
        return key in self.pinned or key in self.lru

    def __len__(self) -> int:
        return len(self.pinned) + len(self.lru)


class PrefixCaches:
    """The caches of one run's workers (numbered as the simulator numbers them), over the
    run's request blocks; `holders`: key -> the workers that hold it (the index)."""

    def __init__(self, blocks: Sequence[Sequence[int]], block_tokens: int,
                 prompt_lens: Sequence[int], capacity_tokens: Sequence[int],
                 lag_s: float = 0.0) -> None:
        """`capacity_tokens`: each worker's KV memory in tokens (one entry a worker); `lag_s`:
        how long after a change the index sees it."""
        if block_tokens < 1 or not capacity_tokens or min(capacity_tokens) < 1:
            raise ValueError("block_tokens and every capacity must be >= 1")
        if lag_s < 0:
            raise ValueError(f"the index lag must be >= 0 s, got {lag_s}")
        self.blocks, self.block_tokens, self.prompt_lens = blocks, block_tokens, prompt_lens
        self.workers = [WorkerCache(c // block_tokens) for c in capacity_tokens]
        self.holders: dict[int, set[int]] = {}  # the index: key -> workers, as it sees them
        self.hits = [0] * len(prompt_lens)  # per request: its computing worker's hit (`pin`)
        self.lag_s, self.now = lag_s, 0.0
        # changes the index does not see yet: (time it sees them, key, worker, cached?)
        self.pending: deque[tuple[float, int, int, bool]] = deque()

    # --- what is held ---------------------------------------------------------------------
    def held_blocks(self, wi: int, r: int) -> int:
        """Request r's leading blocks that worker wi holds."""
        cache, n = self.workers[wi], 0
        for key in self.blocks[r]:
            if key not in cache:
                break
            n += 1
        return n

    def hit(self, wi: int, r: int) -> int:
        """The prompt tokens of request r that worker wi's engine would reuse now."""
        n = self.prompt_lens[r]
        return reusable(min(self.held_blocks(wi, r) * self.block_tokens, n), n,
                        self.block_tokens)

    def cached_on(self, r: int, first: int, count: int) -> dict[str, int]:
        """Per worker first..first+count-1 (named by its number in that pool, as
        `SimWorkerView.worker_id`): the prompt tokens of request r it holds (absent: none)."""
        if self.pending:
            self._catch_up()
        out: dict[str, int] = {}
        live: set[int] | None = None
        n_blocks = 0
        pool = range(first, first + count)
        for key in self.blocks[r]:
            holders = self.holders.get(key)
            now = {w for w in holders if w in pool} if holders else set()
            live = now if live is None else live & now
            if not live:
                break
            n_blocks += 1
            for w in live:
                out[str(w - first)] = n_blocks
        n, b = self.prompt_lens[r], self.block_tokens
        return {w: min(k * b, n) for w, k in out.items()}

    # --- a request's life on a worker -----------------------------------------------------
    def pin(self, wi: int, r: int, hit_tokens: int) -> None:
        """Request r starts on wi reusing `hit_tokens`: pin the blocks they lie in."""
        k = -(-hit_tokens // self.block_tokens)
        cache = self.workers[wi]
        for key in self.blocks[r][:k]:
            self._pin(cache, key)
        cache.held[r] = k
        self.hits[r] = hit_tokens

    def store(self, wi: int, r: int) -> None:
        """Worker wi now holds request r's full blocks: cache them, pinned for r."""
        cache = self.workers[wi]
        full = self.prompt_lens[r] // self.block_tokens
        keys = self.blocks[r]
        for key in keys[cache.held.get(r, 0):full]:
            if key not in cache:
                self._indexed(key, wi, True)
            self._pin(cache, key)
        cache.held[r] = max(full, cache.held.get(r, 0))

    def release(self, wi: int, r: int) -> None:
        """Worker wi freed request r's KV: its blocks stay cached, unpinned (most recent)."""
        cache = self.workers[wi]
        # tail first, as vLLM frees a request's blocks: a prefix's head outlives its tail
        for key in reversed(self.blocks[r][:cache.held.pop(r, 0)]):
            left = cache.pinned[key] - 1
            if left:
                cache.pinned[key] = left
            else:
                del cache.pinned[key]
                cache.lru[key] = None

    def trim(self, wi: int, used_tokens: int) -> None:
        """Evict wi's least recently used unpinned blocks until they fit the KV memory its
        requests leave free (`used_tokens`: the KV tokens they hold)."""
        cache = self.workers[wi]
        room = max(0, cache.capacity_blocks - -(-used_tokens // self.block_tokens))
        lru = cache.lru
        while len(lru) > room:
            key, _ = lru.popitem(last=False)
            self._indexed(key, wi, False)

    # --- the index ------------------------------------------------------------------------
    def _indexed(self, key: int, wi: int, cached: bool) -> None:
        """Worker wi cached (or evicted) `key` now: the index sees it now, or `lag_s` later."""
        if self.lag_s:
            self.pending.append((self.now + self.lag_s, key, wi, cached))
        else:
            self._apply(key, wi, cached)

    def _catch_up(self) -> None:
        """Apply the changes the index sees by `now` (in the order they happened)."""
        pending, now = self.pending, self.now
        while pending and pending[0][0] <= now:
            _, key, wi, cached = pending.popleft()
            self._apply(key, wi, cached)

    def _apply(self, key: int, wi: int, cached: bool) -> None:
        if cached:
            self.holders.setdefault(key, set()).add(wi)
            return
        holders = self.holders.get(key)
        if holders is not None:
            holders.discard(wi)
            if not holders:
                del self.holders[key]

    @staticmethod
    def _pin(cache: WorkerCache, key: int) -> None:
        if key in cache.lru:
            del cache.lru[key]
            cache.pinned[key] = 1
        else:
            cache.pinned[key] = cache.pinned.get(key, 0) + 1
