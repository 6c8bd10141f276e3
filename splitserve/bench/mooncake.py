"""Mooncake-format traces: read, sample, scale, turn into requests; and a seeded generator.

Format (the public Mooncake FAST'25 traces): JSONL, one request a line, with `timestamp` (ms
since the trace's start), `input_length`, `output_length` (tokens) and `hash_ids`: the ids of
the prompt's prefix blocks of `block_tokens` tokens (512 in the public traces). Equal ids at the
same position mean the same prefix (reusable KV); the last block may be partial, so a row needs
(len(hash_ids) − 1) × block < input_length ≤ len(hash_ids) × block (a row without ids is a
prompt that shares nothing).

Replay (`build_mooncake`, in this order; `replay_rows` is rules 1–5 alone, without prompts):
1. rows are sorted by timestamp (stably);
2. `sample_sessions` keeps whole prefix trees: a row's tree is its hash ids up to and including
   its first id that is not shared (an id is shared when more than `shared_fraction` of all
   rows contain it; a row whose ids are all shared is its own tree, as is a row without ids);
   round(fraction × trees), at least 1, are drawn without replacement by the spec's seed;
3. `max_requests` keeps the first N rows left;
4. arrivals are (timestamp − the first kept timestamp) / 1000 / `time_scale` seconds;
5. `token_scale` s: the block becomes b' = round(b × s) tokens (at least 1) and r = b'/b is the
   ratio every length is scaled by. Full blocks stay whole: input = (n − 1) × b' + last', where
   the last block keeps its proportion, last' = round(last × r) clamped to [1, b'] (a row without
   ids: round(input × r), at least 1); output = round(output × r), at least 1. Rounding is half
   up. With s = 1 every length is the trace's own;
6. prompts are made from the hash ids: id h is a fixed block of b' token ids drawn from a
   generator seeded by (spec seed, h) in the synthetic range of workload.py, and the prompt is
   the blocks' concatenation cut to the input length, so equal ids give equal tokens (a partial
   block is a prefix of its full block). A row without ids gets tokens of its own.
Each `Request` carries its `hash_ids` and its tree's number (`session`, in sorted tree order).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.repeat import MooncakeOptions, block_sizes, round_half_up
from splitserve.bench.workload import _TOKEN_HIGH, _TOKEN_LOW, Request, WorkloadSpec

_BLOCK_TAG = 0x6D6F6F6E  # seeds a hash id's block: (seed, tag, id)
_OWN_TAG = 0x6F776E00  # seeds the tokens of a row without ids: (seed, tag, row)
_SAMPLE_TAG = 0x73616D70  # seeds the choice of prefix trees


@dataclass(frozen=True)
class TraceRow:
    """One request of a Mooncake-format trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.input_length < 1 or self.output_length < 1:
            raise ValueError("input_length and output_length must be >= 1")
        if any(h < 0 for h in self.hash_ids):
            raise ValueError("hash ids must be >= 0")

    def check_blocks(self, block_tokens: int) -> None:
        n = len(self.hash_ids)
        if n and not (n - 1) * block_tokens < self.input_length <= n * block_tokens:
            raise ValueError(f"input_length {self.input_length} does not fill {n} hash blocks "
                             f"of {block_tokens} tokens (the last one partial)")

    def to_dict(self) -> dict[str, Any]:
        return {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


def read_mooncake(path: str | Path) -> list[TraceRow]:
    """The rows of a Mooncake-format JSONL file (blank lines skipped), in file order."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            ts = float(d["timestamp"])
            rows.append(TraceRow(ts, int(d["input_length"]), int(d["output_length"]),
                                 tuple(int(h) for h in d.get("hash_ids") or ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: not a Mooncake trace row: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no trace rows")
    return rows


def write_mooncake(rows: Sequence[TraceRow], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rows))
    return p


def tree_keys(rows: Sequence[TraceRow], shared_fraction: float) -> list[tuple[int, ...]]:
    """Each row's prefix tree (see the module docstring); rows without ids get (−1 − row,)."""
    counts = Counter(h for r in rows for h in set(r.hash_ids))
    limit = shared_fraction * len(rows)
    keys: list[tuple[int, ...]] = []
    for i, r in enumerate(rows):
        cut = next((j for j, h in enumerate(r.hash_ids) if counts[h] <= limit), None)
        if not r.hash_ids:
            keys.append((-1 - i,))
        else:
            keys.append(r.hash_ids if cut is None else r.hash_ids[:cut + 1])
    return keys


def sample_trees(keys: Sequence[tuple[int, ...]], fraction: float, seed: int
                 ) -> set[tuple[int, ...]]:
    """round(fraction × distinct keys), at least 1, drawn by `seed` (deterministic)."""
    distinct = sorted(set(keys))
    k = max(1, round_half_up(fraction * len(distinct)))
    rng = np.random.default_rng([seed, _SAMPLE_TAG])
    return {distinct[int(i)] for i in rng.choice(len(distinct), size=k, replace=False)}


def scale_lengths(row: TraceRow, opts: MooncakeOptions) -> tuple[int, int]:
    """(input, output) tokens of `row` after `token_scale` (rule 5 of the module docstring)."""
    b, b2 = opts.block_tokens, opts.scaled_block_tokens
    ratio = b2 / b
    n = len(row.hash_ids)
    if n == 0:
        n_in = max(1, round_half_up(row.input_length * ratio))
    else:
        last = row.input_length - (n - 1) * b
        n_in = (n - 1) * b2 + min(b2, max(1, round_half_up(last * ratio)))
    return n_in, max(1, round_half_up(row.output_length * ratio))


def block_of(seed: int, hash_id: int, block_tokens: int) -> tuple[int, ...]:
    """The token ids of hash block `hash_id` (the same for every request of a stream)."""
    rng = np.random.default_rng([seed, _BLOCK_TAG, hash_id])
    return tuple(int(x) for x in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=block_tokens))


def prompt_of(hash_ids: Sequence[int], input_len: int, seed: int, block_tokens: int,
              cache: dict[int, tuple[int, ...]] | None = None, row: int = 0
              ) -> tuple[int, ...]:
    """The prompt of a request: its blocks concatenated, cut to `input_len` (rule 6)."""
    if not hash_ids:
        rng = np.random.default_rng([seed, _OWN_TAG, row])
        return tuple(int(x) for x in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=input_len))
    cache = {} if cache is None else cache
    out: list[int] = []
    for h in hash_ids:
        if h not in cache:
            cache[h] = block_of(seed, h, block_tokens)
        out.extend(cache[h])
    return tuple(out[:input_len])


def select_rows(rows: Sequence[TraceRow], opts: MooncakeOptions, seed: int
                ) -> list[tuple[TraceRow, int]]:
    """Rules 1–3: the kept rows in time order, each with its tree's number."""
    ordered = sorted(rows, key=lambda r: r.timestamp_ms)
    keys = tree_keys(ordered, opts.shared_fraction)
    number = {k: i for i, k in enumerate(sorted(set(keys)))}
    kept = [(r, number[k]) for r, k in zip(ordered, keys, strict=True)]
    if opts.sample_sessions is not None:
        chosen = {number[k] for k in sample_trees(keys, opts.sample_sessions, seed)}
        kept = [(r, s) for r, s in kept if s in chosen]
    if opts.max_requests is not None:
        kept = kept[:opts.max_requests]
    return kept


@dataclass(frozen=True)
class ReplayedRow:
    """One kept row of a replay (rules 1–5): its tree's number, arrival (s) and scaled lengths."""

    row: TraceRow
    tree: int
    arrival_s: float
    input_len: int
    output_len: int


def replay_rows(spec: WorkloadSpec) -> list[ReplayedRow]:
    """Rules 1–5 of a `mooncake` spec: the kept rows in time order, with arrivals and scaled
    lengths, without making prompts (`build_mooncake` adds rule 6 to exactly these)."""
    opts = spec.mooncake
    rows = read_mooncake(str(spec.path))
    for i, r in enumerate(rows):
        try:
            r.check_blocks(opts.block_tokens)
        except ValueError as exc:
            raise ValueError(f"{spec.path}: row {i + 1}: {exc}") from None
    kept = select_rows(rows, opts, spec.seed)
    t0 = kept[0][0].timestamp_ms
    return [ReplayedRow(r, tree, (r.timestamp_ms - t0) / 1000.0 / opts.time_scale,
                        *scale_lengths(r, opts)) for r, tree in kept]


def build_mooncake(spec: WorkloadSpec) -> list[Request]:
    """The measured requests of a `mooncake` spec (see the module docstring)."""
    b2 = spec.mooncake.scaled_block_tokens
    cache: dict[int, tuple[int, ...]] = {}
    out = []
    for i, k in enumerate(replay_rows(spec)):
        prompt = prompt_of(k.row.hash_ids, k.input_len, spec.seed, b2, cache, i)
        out.append(Request(i, k.arrival_s, prompt, k.output_len, hash_ids=k.row.hash_ids,
                           session=k.tree))
    return out


@dataclass(frozen=True)
class TraceShape:
    """What `make_trace` generates: conversation sessions in the Mooncake format. Sessions start
    as a Poisson process; each has 1..`max_turns` turns (uniform), the next turn
    exponential(`think_s`) after the previous one. Every prompt starts with `system_blocks`
    shared blocks; each turn adds uniform [`user_min`, `user_max`] user tokens to the
    conversation, and its answer (uniform [`output_min`, `output_max`] tokens) joins the
    conversation before the next turn, which resends all of it."""

    sessions: int = 50
    max_turns: int = 5
    system_blocks: int = 1
    session_rate: float = 0.5
    think_s: float = 20.0
    user_min: int = 64
    user_max: int = 1024
    output_min: int = 32
    output_max: int = 512
    block_tokens: int = 512

    def __post_init__(self) -> None:
        if min(self.sessions, self.max_turns, self.user_min, self.output_min,
               self.block_tokens) < 1 or self.system_blocks < 0:
            raise ValueError("counts and lengths must be >= 1 (system_blocks >= 0)")
        if self.user_min > self.user_max or self.output_min > self.output_max:
            raise ValueError("need min <= max for user and output tokens")
        if not (self.session_rate > 0 and self.think_s >= 0):
            raise ValueError("session_rate must be > 0 and think_s >= 0")


def make_trace(shape: TraceShape = TraceShape(), seed: int = 0) -> list[TraceRow]:
    """A seeded Mooncake-format trace of conversations (see `TraceShape`), sorted by time.

    Ids 0..system_blocks−1 are the shared system prompt's blocks. A conversation's full blocks
    keep their ids from turn to turn; a partial last block gets an id of its own (its content
    differs from the full block that later takes its place)."""
    rng = np.random.default_rng([seed, 0x6D616B65])
    b = shape.block_tokens
    next_id = shape.system_blocks
    rows: list[TraceRow] = []
    start = 0.0
    for _ in range(shape.sessions):
        start += float(rng.exponential(1.0 / shape.session_rate))
        t, history = start, shape.system_blocks * b
        full_ids = list(range(shape.system_blocks))  # ids of the conversation's full blocks
        for turn in range(int(rng.integers(1, shape.max_turns + 1))):
            if turn:
                t += float(rng.exponential(shape.think_s)) if shape.think_s else 0.0
            n_in = history + int(rng.integers(shape.user_min, shape.user_max + 1))
            n_out = int(rng.integers(shape.output_min, shape.output_max + 1))
            while len(full_ids) < n_in // b:
                full_ids.append(next_id)
                next_id += 1
            ids = full_ids[:n_in // b]
            if n_in % b:
                ids.append(next_id)
                next_id += 1
            rows.append(TraceRow(round(t * 1000.0, 3), n_in, n_out, tuple(ids)))
            history = n_in + n_out
    return sorted(rows, key=lambda r: r.timestamp_ms)


def stream_block_sizes(req: Request, block_tokens: int) -> list[int]:
    """Tokens in each of a replayed request's hash blocks."""
    return block_sizes(req.input_len, len(req.hash_ids), block_tokens)
