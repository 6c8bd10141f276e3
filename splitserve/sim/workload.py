"""The simulator's view of a request stream: three arrays and the prompts' prefix identity, and
the one place that knows the benchmark's workload spec (`splitserve.bench.workload`).

The simulator never needs prompt token ids, only lengths, arrival times and which prompt prefixes
are equal. `arrays_from_spec` gives, request for request, the lengths and arrivals of the
benchmark's `build_stream`:
- `synthetic`: drawn with the same generator calls, in the same order, without building prompts;
  no prefix identity (random prompts share nothing);
- `mooncake`: the replay of `splitserve.bench.mooncake` (`replay_rows`) without building prompts;
  the keys are the trace's hash ids, in blocks of the scaled block size;
- every other source: `build_stream` itself, keys hashed from the prompts' token ids
  (`prefix_keys`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from splitserve.bench.mooncake import replay_rows
from splitserve.bench.workload import WorkloadSpec, build_stream


class RequestLike(Protocol):
    @property
    def arrival_s(self) -> float: ...

    @property
    def output_len(self) -> int: ...

    @property
    def input_len(self) -> int: ...


@dataclass(frozen=True, eq=False)
class SimWorkload:
    """Arrival offsets (s, sorted), prompt lengths and output lengths (tokens, >= 1), and the
    prompts' prefix identity when the stream has one.

    `blocks[i]`: request i's prompt as prefix blocks of `block_tokens` tokens, each a key that
    names the whole prefix up to and including that block (equal keys: equal prefixes, so
    reusable KV); the last block may be partial. None: prompts that share nothing (every
    prefix cache misses)."""

    arrivals: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    blocks: tuple[tuple[int, ...], ...] | None = None
    block_tokens: int = 0

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if len(self.prompt_lens) != n or len(self.output_lens) != n:
            raise ValueError("arrivals, prompt_lens and output_lens must have the same length")
        if self.blocks is not None:
            if len(self.blocks) != n or self.block_tokens < 1:
                raise ValueError("blocks needs one entry per request and block_tokens >= 1")
            b = self.block_tokens
            for i, (keys, n_tok) in enumerate(zip(self.blocks, self.prompt_lens.tolist(),
                                                  strict=True)):
                if len(keys) != -(-n_tok // b):
                    raise ValueError(f"request {i}: {n_tok} prompt tokens are "
                                     f"{-(-n_tok // b)} blocks of {b}, not {len(keys)}")
        if n == 0:
            raise ValueError("a workload needs at least one request")
        if np.any(np.diff(self.arrivals) < 0):
            raise ValueError("arrivals must be sorted")
        if self.prompt_lens.min() < 1 or self.output_lens.min() < 1:
            raise ValueError("prompt and output lengths must be >= 1")

    def __len__(self) -> int:
        return len(self.arrivals)

    @classmethod
    def of(cls, arrivals: Iterable[float], prompt_lens: Iterable[int],
           output_lens: Iterable[int]) -> SimWorkload:
        return cls(np.asarray(list(arrivals), dtype=np.float64),
                   np.asarray(list(prompt_lens), dtype=np.int64),
                   np.asarray(list(output_lens), dtype=np.int64))

    @property
    def offered_rate(self) -> float:
        span = float(self.arrivals[-1] - self.arrivals[0])
        return (len(self) - 1) / span if span > 0 else float("inf")

    def at_rate(self, rate: float, base: float | None = None) -> SimWorkload:
        """This stream offered at `rate` requests/s for as long as it lasts at `base` (default:
        `offered_rate`), so that a rate sweep compares equal durations, not equal counts (a
        fixed count at a high rate is one burst that a large deployment merely absorbs).

        Arrival offsets are scaled by base/rate. Below `base` the stream is cut at the duration
        (at least one request); above it, back-to-back copies of the scaled stream fill the
        duration, each copy's prefix keys made distinct from every other copy's (a copy is
        other users: it shares no prefix with the original)."""
        base = self.offered_rate if base is None else base
        if not rate > 0 or not base > 0:
            raise ValueError(f"rates must be positive, got rate={rate} base={base}")
        n = len(self)
        if not np.isfinite(base):
            return self
        scaled = (self.arrivals - self.arrivals[0]) * (base / rate)
        period = max(n / rate, float(scaled[-1]) + 1 / rate)  # one copy, a gap included
        duration = period * rate / base
        copies = max(1, int(np.ceil(rate / base)))
        arrivals = np.concatenate([scaled + j * period for j in range(copies)])
        keep = max(1, int(np.searchsorted(arrivals, duration, side="left")))
        blocks = None
        if self.blocks is not None:
            blocks = tuple(keys if j == 0 else tuple(hash((j, k)) for k in keys)
                           for j in range(copies) for keys in self.blocks)[:keep]
        return SimWorkload(arrivals[:keep] + self.arrivals[0],
                           np.tile(self.prompt_lens, copies)[:keep],
                           np.tile(self.output_lens, copies)[:keep], blocks, self.block_tokens)


def prefix_keys(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """`token_ids` as prefix keys of `block_tokens`-token blocks (the last may be partial): key k
    is the hash of (key k−1, block k's tokens), so equal token prefixes give equal keys and a
    partial block's key differs from its full block's. Deterministic across processes (hashes
    of ints and tuples of ints are not salted)."""
    keys: list[int] = []
    prev = 0
    for start in range(0, len(token_ids), block_tokens):
        prev = hash((prev, tuple(token_ids[start:start + block_tokens])))
        keys.append(prev)
    return tuple(keys)


def from_requests(requests: Iterable[RequestLike], block_tokens: int | None = None
                  ) -> SimWorkload:
    """`requests` sorted by arrival (stably). With `block_tokens`, prefix keys (`prefix_keys`)
    when every request has `prompt_token_ids` of its `input_len`; otherwise no prefix identity."""
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    wl = SimWorkload.of((r.arrival_s for r in reqs), (r.input_len for r in reqs),
                        (r.output_len for r in reqs))
    if block_tokens is None:
        return wl
    ids = [getattr(r, "prompt_token_ids", None) for r in reqs]
    if any(t is None or len(t) != r.input_len for t, r in zip(ids, reqs, strict=True)):
        return wl
    blocks = tuple(prefix_keys(t, block_tokens) for t in ids if t is not None)
    return SimWorkload(wl.arrivals, wl.prompt_lens, wl.output_lens, blocks, block_tokens)


def _mooncake_arrays(spec: WorkloadSpec) -> SimWorkload:
    """The replay of `spec`'s trace (`replay_rows`): keys are the rows' hash ids, and a row
    without ids gets negative keys that no other block shares."""
    b2 = spec.mooncake.scaled_block_tokens
    kept = replay_rows(spec)
    blocks: list[tuple[int, ...]] = []
    fresh = -1
    for k in kept:
        if k.row.hash_ids:
            blocks.append(k.row.hash_ids)
        else:
            n = -(-k.input_len // b2)
            blocks.append(tuple(range(fresh, fresh - n, -1)))
            fresh -= n
    return SimWorkload(np.fromiter((k.arrival_s for k in kept), np.float64, len(kept)),
                       np.fromiter((k.input_len for k in kept), np.int64, len(kept)),
                       np.fromiter((k.output_len for k in kept), np.int64, len(kept)),
                       tuple(blocks), b2)


def check_open_loop(spec: WorkloadSpec) -> None:
    """ValueError unless `spec` sends its requests open-loop: the simulator replays open-loop
    arrivals only, so a closed loop or a concurrency cap is refused rather than silently
    simulated as something else."""
    if spec.arrival.kind == "closed" or spec.arrival.max_concurrency is not None:
        raise ValueError("the simulator replays open-loop arrivals; closed-loop workloads and "
                         "max_concurrency are not simulated")


def arrays_from_spec(spec: WorkloadSpec, block_tokens: int = 128) -> SimWorkload:
    """The measured stream of `spec` as arrays (warm-up requests are not part of it), with its
    prefix identity (see the module docstring): keys of `block_tokens`-token blocks, except for
    `mooncake` (the trace's scaled block size; `block_tokens` is ignored) and `synthetic` (none).
    ValueError for what `check_open_loop` refuses."""
    check_open_loop(spec)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if spec.source == "mooncake":
        return _mooncake_arrays(spec)
    if spec.source != "synthetic":
        return from_requests(build_stream(spec), block_tokens)
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    ins = spec.input.sample(rng, n)
    outs = spec.output.sample(rng, n)
    times = np.cumsum(spec.arrival.gaps(rng, n))
    return SimWorkload(times.astype(np.float64), np.asarray(ins, dtype=np.int64),
                       np.asarray(outs, dtype=np.int64))
