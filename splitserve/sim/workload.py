"""The simulator's view of a request stream: three arrays, and the one place that knows the
benchmark's workload spec (`splitserve.bench.workload`).

The simulator never needs prompt token ids, only lengths and arrival times, so
`arrays_from_spec` draws the lengths and arrivals with the same generator calls, in the same
order, as the benchmark's `build_stream` — the same stream without building millions of prompts.
For sources with files (ShareGPT, traces) and for the interference mix it goes through
`build_stream` itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

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
    """Arrival offsets (s, sorted), prompt lengths and output lengths (tokens, >= 1)."""

    arrivals: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if len(self.prompt_lens) != n or len(self.output_lens) != n:
            raise ValueError("arrivals, prompt_lens and output_lens must have the same length")
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


def from_requests(requests: Iterable[RequestLike]) -> SimWorkload:
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    return SimWorkload.of((r.arrival_s for r in reqs), (r.input_len for r in reqs),
                          (r.output_len for r in reqs))


def arrays_from_spec(spec: WorkloadSpec) -> SimWorkload:
    """The measured stream of `spec` as arrays (warm-up requests are not part of it).

    The simulator replays open-loop arrivals only: a closed loop or a concurrency cap is refused
    rather than silently simulated as something else."""
    if spec.arrival.kind == "closed" or spec.arrival.max_concurrency is not None:
        raise ValueError("the simulator replays open-loop arrivals; closed-loop workloads and "
                         "max_concurrency are not simulated")
    if spec.source != "synthetic":
        return from_requests(build_stream(spec))
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    ins = spec.input.sample(rng, n)
    outs = spec.output.sample(rng, n)
    times = np.cumsum(spec.arrival.gaps(rng, n))
    return SimWorkload(times.astype(np.float64), np.asarray(ins, dtype=np.int64),
                       np.asarray(outs, dtype=np.int64))

