"""Workloads that repeat themselves: their parts of a `WorkloadSpec`, and their ideal reuse.

Two sources repeat prompt prefixes on purpose (see mooncake.py and multiturn.py):
- `mooncake` replays a Mooncake-format trace (FAST'25; JSONL: `timestamp` ms, `input_length`,
  `output_length`, `hash_ids` of fixed-size prefix blocks) — `MooncakeOptions`;
- `multiturn` runs chat sessions whose every turn resends the conversation — `MultiturnOptions`.

Ideal reuse (`PrefixPool`): the share of prompt tokens that repeat a prefix already seen earlier
in the stream, as one pool with an unbounded cache would see it. Requests are taken in order
(arrival order for a trace, send order for sessions); each one's reused tokens are the length
of the longest prefix of its units that an earlier request inserted, then its own units are
inserted. Units are hash blocks for a trace (a block matches when every block before it and the
block itself — id and token count — match) and tokens for sessions (a turn inserts its prompt
and the answer the server generated, so the next turn of the conversation finds both).
It ignores the engine's block granularity and cache size: a real cache reuses at most this.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

TRACE_BLOCK_TOKENS = 512  # the public Mooncake traces' hash-block size


@dataclass(frozen=True)
class MooncakeOptions:
    """How a Mooncake-format trace is replayed (see mooncake.py for the exact rules).

    `block_tokens`: the trace's hash-block size. `token_scale`: every length is multiplied by it
    with hash blocks kept whole (the block becomes `scaled_block_tokens`). `time_scale`: arrivals
    come this many times faster. `max_requests`: keep the first N (after sampling).
    `sample_sessions`: keep this fraction of prefix trees, chosen by the spec's seed; a tree is
    keyed by a request's hash ids up to and including its first id that is not *shared*, and an
    id is shared when more than `shared_fraction` of all requests contain it."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    token_scale: float = 1.0
    time_scale: float = 1.0
    max_requests: int | None = None
    sample_sessions: float | None = None
    shared_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        for name in ("token_scale", "time_scale"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive finite number, got {v}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        if self.sample_sessions is not None and not 0 < self.sample_sessions <= 1:
            raise ValueError(f"sample_sessions must be in (0, 1], got {self.sample_sessions}")
        if not 0 < self.shared_fraction <= 1:
            raise ValueError(f"shared_fraction must be in (0, 1], got {self.shared_fraction}")

    @property
    def scaled_block_tokens(self) -> int:
        """Tokens per hash block in the replayed stream: round(block_tokens × token_scale),
        at least 1."""
        return max(1, round_half_up(self.block_tokens * self.token_scale))


@dataclass(frozen=True)
class MultiturnOptions:
    """Chat sessions (see multiturn.py). Sessions start at the spec's arrival process (its rate
    is sessions per second); each runs `turns` turns closed-loop, `think_time_s` after the last
    answer ended. Every session's history starts with one shared system prompt."""

    sessions: int = 8
    turns: int = 4
    system_tokens: int = 256
    user_tokens: int = 64
    output_tokens: int = 64
    think_time_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "user_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.system_tokens < 0:
            raise ValueError("system_tokens must be >= 0")
        if not (self.think_time_s >= 0 and math.isfinite(self.think_time_s)):
            raise ValueError("think_time_s must be a finite number >= 0")


def round_half_up(x: float) -> int:
    """Nearest integer, halves up (Python's round() goes to even)."""
    return int(math.floor(x + 0.5))


class PrefixPool:
    """An unbounded prefix cache over units (hash blocks or tokens), each with a token weight.

    `match_insert(units, weights)` returns the tokens of the longest prefix of `units` that an
    earlier call inserted, then inserts `units` (a trie of dicts: one node per distinct prefix).
    """

    def __init__(self) -> None:
        self._root: dict[Hashable, Any] = {}

    def match_insert(self, units: Sequence[Hashable], weights: Sequence[int] | None = None
                     ) -> int:
        node, reused, matching = self._root, 0, True
        for i, unit in enumerate(units):
            child = node.get(unit)
            if child is None:
                matching = False
                child = node[unit] = {}
            elif matching:
                reused += 1 if weights is None else weights[i]
            node = child
        return reused


@dataclass(frozen=True)
class IdealReuse:
    """Prompt tokens of a stream and those an unbounded single cache could have reused."""

    prompt_tokens: int
    reused_tokens: int

    @property
    def fraction(self) -> float | None:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_result(self) -> dict[str, Any]:
        """The result JSON's keys."""
        return {"ideal_reuse": self.fraction, "ideal_reused_tokens": self.reused_tokens,
                "ideal_computed_tokens": self.prompt_tokens - self.reused_tokens}


def block_sizes(input_len: int, n_blocks: int, block_tokens: int) -> list[int]:
    """Tokens in each of a prompt's `n_blocks` hash blocks (the last one may be partial)."""
    return [min(block_tokens, input_len - i * block_tokens) for i in range(n_blocks)]


def ideal_reuse_blocks(prompts: Iterable[tuple[Sequence[int], int]], block_tokens: int
                       ) -> IdealReuse:
    """Ideal reuse of `(hash_ids, input_len)` prompts in order, by hash blocks (a block is the
    unit `(id, tokens in it)`; tokens past the last block, if any, are never reused)."""
    pool, total, reused = PrefixPool(), 0, 0
    for ids, n in prompts:
        sizes = block_sizes(n, len(ids), block_tokens)
        total += n
        reused += pool.match_insert(list(zip(ids, sizes, strict=True)), sizes)
    return IdealReuse(total, reused)


def ideal_reuse_tokens(turns: Iterable[tuple[Sequence[int], Sequence[int]]]) -> IdealReuse:
    """Ideal reuse of `(prompt, answer)` token sequences in send order, by tokens: each prompt
    matches against every earlier prompt + answer."""
    pool, total, reused = PrefixPool(), 0, 0
    for prompt, answer in turns:
        total += len(prompt)
        reused += min(len(prompt), pool.match_insert([*prompt, *answer]))
    return IdealReuse(total, reused)
