"""One simulated worker's state (`Worker`: its queues, batch, KV, the step in progress), its
scheduler's choice of prompt chunks per step within its `Limits`, and the closed form of a
decode-only segment (`steps_done`, `next_boundary`); the steps that move it are
`stepping.py`'s, the event loop and the requests' hand-offs between workers `simulator.py`'s."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from enum import IntEnum

from splitserve.sim.costmodel import DecodeCost, PrefillCost
from splitserve.sim.deployment import Segment
from splitserve.sim.prefixcache import PrefixCaches


class Role(IntEnum):
    PREFILL = 0  # a P-worker: prefills, hands the KV on
    DECODE = 1  # a D-worker: admits decode legs, decodes
    COLOCATED = 2  # one engine doing both (the colocated and chunked baselines)


class StepKind(IntEnum):
    """What a busy worker is doing."""

    STEP = 0  # one engine step (`step_dur` long)
    SEGMENT = 1  # a run of decode-only steps in closed form (`alpha`, `beta`, `seg_steps`)
    KV_WAIT = 2  # nothing runnable until a transfer frees KV


PREFILL, DECODE, COLOCATED = Role.PREFILL, Role.DECODE, Role.COLOCATED
STEP, SEGMENT, KV_WAIT = StepKind.STEP, StepKind.SEGMENT, StepKind.KV_WAIT


@dataclass(frozen=True)
class Limits:
    """One engine's scheduler limits: tokens per step, running requests, KV tokens held;
    `chunked`: a prompt may be split over steps (vLLM's chunked prefill)."""

    token_budget: int
    max_seqs: int
    kv_capacity: int
    chunked: bool

    def __post_init__(self) -> None:
        if min(self.token_budget, self.max_seqs, self.kv_capacity) < 1:
            raise ValueError("Limits need token_budget, max_seqs and kv_capacity >= 1")


class Worker:
    """One engine's scheduler state. Requests are indices into the run's arrays.

    `queue`: prompts to prefill, FIFO (`head_done` tokens of the head already prefilled);
    `waiting`: decode legs waiting for admission (D); `running`: the decoding requests as a heap
    of (the step count at which each finishes, request); `batch`, `context`: how many run and
    their total context tokens; `steps`: steps done so far; `kv_used` / `kv_release`: KV tokens
    held and (time, tokens, request) that transfers still hold; `load`: what the router balances
    on; `caches`: the run's prefix caches (None: none), this worker's is number `wi`;
    `new`: requests admitted since the last step (their t2 comes with the next); `joined`: the
    requests whose t2 the step in progress emits, `n_joined`: the requests that emit no
    inter-token gap in it (joiners, and replayers' t2); `replaying`: pulled legs (NIXL) whose
    step in progress replays t1 (their t2 comes with the next step); `version`: bumped at every
    reschedule, so a superseded step event is skipped."""

    __slots__ = ("role", "queue", "head_done", "waiting", "running", "batch", "context",
                 "steps", "busy", "kind", "started", "alpha", "beta", "seg_steps", "cut",
                 "version", "kv_used", "kv_release", "load", "chunks", "new", "n_joined",
                 "step_dur", "prefill_cost", "decode_cost", "joined", "batch_term", "replaying",
                 "caches", "wi", "prefill_s")

    def __init__(self, role: Role, pf: PrefillCost, dc: DecodeCost, max_seqs: int,
                 caches: PrefixCaches | None = None, wi: int = 0) -> None:
        self.role, self.prefill_cost, self.decode_cost = role, pf, dc
        self.caches, self.wi = caches, wi
        self.prefill_s = 0.0  # seconds of steps that prefilled (mixed ones too)
        # dc.batch_term(B) for B = 0..max_seqs: looked up on every step, computed once
        self.batch_term = [dc.batch_term(b) for b in range(max_seqs + 1)]
        self.queue: deque[int] = deque()
        self.head_done = 0
        self.waiting: deque[int] = deque()
        self.running: list[tuple[int, int]] = []
        self.batch = self.context = self.steps = self.seg_steps = self.version = 0
        self.kv_used = self.load = self.n_joined = 0
        self.busy = self.cut = False
        self.kind: StepKind = STEP
        self.started = self.alpha = self.beta = self.step_dur = 0.0
        self.kv_release: list[tuple[float, int, int]] = []
        self.chunks: list[tuple[int, int, int]] = []
        self.new: list[int] = []
        self.joined: list[int] = []  # the requests whose t2 the step in progress emits
        self.replaying: list[int] = []  # the requests whose t1 replay the step in progress is

    def take_chunks(self, t: float, lim: Limits, prompt_lens: list[int], output_lens: list[int],
                    failed: list[bool], prefill_start: list[float], charged: list[int]
                    ) -> list[int]:
        """Fill `chunks` with the next step's prompt chunks at t, FIFO from `queue`, within the
        token budget its decodes leave, `max_seqs` and KV capacity (KV whose transfers ended
        by t is released first). A prompt starts after its prefix-cache hit (its first chunk
        begins there). A prompt that can never fit is marked in `failed` (a P takes back its
        `charged` load) and returned, for the caller to undo its load elsewhere (its D's); a
        prompt started gets its `prefill_start`; unchunked (`lim.chunked` False), a prompt that
        does not fit the budget left waits for a step of its own."""
        chunks, rel, queue, caches = self.chunks, self.kv_release, self.queue, self.caches
        dropped: list[int] = []
        while rel and rel[0][0] <= t:
            _, tokens, done_r = heapq.heappop(rel)
            self.kv_used -= tokens
            if caches is not None:
                caches.release(self.wi, done_r)
        budget, cap, chunked = lim.token_budget - self.batch, lim.kv_capacity, lim.chunked
        while queue and budget > 0:
            r = queue[0]
            done = self.head_done
            fresh = done == 0
            if fresh:
                if self.batch + len(chunks) >= lim.max_seqs:
                    break
                need = prompt_lens[r] + (output_lens[r] if self.role != PREFILL else 0)
                if need > cap:
                    queue.popleft()
                    failed[r] = True
                    self.load -= charged[r] if self.role == PREFILL else 1
                    dropped.append(r)
                    continue
                if self.kv_used + need > cap:
                    break
                if caches is not None:
                    done = caches.hit(self.wi, r)
            rest = prompt_lens[r] - done
            if not chunked and rest > budget and chunks:
                break
            q = rest if not chunked else min(rest, budget)
            if fresh:
                self.kv_used += need
                prefill_start[r] = t
                if caches is not None:
                    caches.pin(self.wi, r, done)
                    caches.trim(self.wi, self.kv_used)
            chunks.append((r, q, done))
            budget -= q
            if q == rest:
                queue.popleft()
                self.head_done = 0
            else:
                self.head_done = done + q
        return dropped

    def start_chunk_step(self, t: float) -> float:
        """Start the step that prefills `chunks` (and runs the decodes) at t: its duration (a
        mixed step pays one fixed cost, the larger, and both variable parts)."""
        pf, dc, chunks = self.prefill_cost, self.decode_cost, self.chunks
        tok = sum(c[1] for c in chunks)
        quad = sum(q * q + 2 * p * q for _, q, p in chunks)
        dur = pf.time(tok, quad)
        if self.batch:
            dur += dc.b * self.context + self.batch_term[self.batch] + max(0.0, dc.a - pf.a)
        self.kind, self.step_dur, self.started = STEP, dur, t
        self.prefill_s += dur
        return dur

    def cut_short(self, t: float) -> float | None:
        """End the decode-only segment in progress (if any, not cut already) at its next step
        boundary after t: that boundary, when it comes before the segment's end (else None:
        the segment ends there anyway)."""
        if not (self.busy and self.kind == SEGMENT and not self.cut):
            return None
        self.cut = True
        k = steps_done(self.alpha, self.beta, t - self.started) + 1
        if k >= self.seg_steps:
            return None
        self.seg_steps = k
        return self.started + self.alpha * k + self.beta * k * (k - 1) / 2

    def split_segment(self, t: float, wi: int) -> Segment | None:
        """Make the step in progress at t a step of its own (it is about to change): a
        segment's steps done by t are left behind as a segment, returned as its record for the
        run's `segs` (None: none done, or no segment in progress; `wi`: this worker's index)."""
        if self.kind != SEGMENT:
            return None
        done = min(steps_done(self.alpha, self.beta, t - self.started), self.seg_steps - 1)
        t0 = self.started + self.alpha * done + self.beta * done * (done - 1) / 2
        record = None
        if done:
            record = (self.alpha, self.beta, done, self.batch, self.n_joined, self.started, wi,
                      self.steps)
            self.steps += done
            self.context += done * self.batch
            self.n_joined = 0
            self.joined.clear()  # their t2 came with the segment's first step
        self.kind, self.step_dur = STEP, self.alpha + self.beta * done
        self.started = t0
        return record


def next_boundary(w: Worker, t: float) -> float:
    """When the step that busy worker `w` runs at t ends (in a segment: that step of it)."""
    if w.kind != SEGMENT:
        return w.started + w.step_dur
    k = min(steps_done(w.alpha, w.beta, t - w.started) + 1, w.seg_steps)
    return w.started + w.alpha * k + w.beta * k * (k - 1) / 2


def steps_done(alpha: float, beta: float, elapsed: float) -> int:
    """Largest k with T(k) = α·k + β·k(k−1)/2 <= elapsed."""
    if beta <= 0.0:
        k = int(elapsed / alpha)
    else:
        h = alpha - beta / 2
        k = int((-h + math.sqrt(h * h + 2 * beta * elapsed)) / beta)
    while k > 0 and alpha * k + beta * k * (k - 1) / 2 > elapsed:
        k -= 1
    while alpha * (k + 1) + beta * (k + 1) * k / 2 <= elapsed:
        k += 1
    return k
