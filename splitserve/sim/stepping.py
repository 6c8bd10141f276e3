"""How a simulated worker steps, as vLLM's v1 scheduler does (`WorkerStepping`): it admits
decode legs, plans the worker's next step or decode-only segment, and settles the end of the
step in progress (tokens emitted, requests finished, KV freed). `simulator.Simulation`, the
event loop, derives from it; this module never imports the loop.

Contract with the loop:

- the loop owns the state declared on `WorkerStepping` (the run's per-request lists, indexed by
  request; `lim`, by worker; `segs`, the decode-step record) and the event heap; the methods
  here change only that state, the workers (with their prefix caches) and, through its hooks,
  the overlay;
- the loop provides `_schedule` (put a worker's step end on the heap, superseding the one
  scheduled before) and `_prefilled` (a P-worker finished a prompt: the KV hand-off);
- the loop calls `_poke` when new work reaches a worker, `_boundary` when a worker's step (or
  segment) event fires, and `_plan` when a worker waiting on KV (`KV_WAIT`) wakes.

Invariants:

- a worker is `busy` exactly while it has one live step event: a step, a segment, or a wait
  on KV (`KV_WAIT`: until the first transfer that holds its KV ends);
- a decode-only segment runs one batch at one pace until its first request finishes, so step
  k lasts α + β·k and its end is closed-form: new work cuts it at its next step boundary
  (`cut_segment`), the overlay's work splits it (the loop's `extend_decode_step`);
- `running` holds (the worker's `steps` once the request has emitted its last token,
  request); a step's end finishes exactly the requests whose count it reached;
- a worker's `kv_used` holds each request's prompt + output tokens (P: its prompt) from its
  admission or first chunk until it finishes (P: until its transfer frees it);
- a joiner's t2 is set when its first decode step starts, to that step's planned end; under
  `replay` a leg's first step on D replays t1, so its t2 comes with the step after.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod

from splitserve.sim.deployment import Segment
from splitserve.sim.overlay import Overlay
from splitserve.sim.workerstate import DECODE, KV_WAIT, PREFILL, SEGMENT, STEP, Limits, Worker


class WorkerStepping(ABC):
    """The per-worker scheduler steps of one run. Requests are indices into the run's lists;
    worker `wi` is `W[wi]`, D-worker d is `wi = npw + d`. The attributes below are the loop's,
    set before its first event."""

    overlay: Overlay  # the run's overlay; its per-event hooks only while `active`
    npw: int  # P-workers (colocated: all workers)
    replay: bool  # a decode leg's first step on D replays t1 (nixl, mooncake)
    lim: list[Limits]  # by worker
    prompt_lens: list[int]
    output_lens: list[int]
    local: list[bool]  # run whole on its D (prefill on D)
    charged: list[int]  # the prompt tokens it queued on its P (that P's `load`)
    failed: list[bool]
    prefill_start: list[float]
    t1: list[float]
    t2: list[float]
    finish: list[float]
    D: list[Worker]  # the D-workers (D-worker d is `W[npw + d]`)
    decode_of: list[int]  # the D-worker (by number) the router gave it (-1: none)
    decode_worker: list[int]  # the worker it decoded on (-1: none)
    join_step: list[int]  # that worker's step count when it joined the batch
    segs: list[Segment]  # every decode step run, as segments

    @abstractmethod
    def _schedule(self, wi: int, w: Worker, end: float) -> None:
        """Mark `w` busy until `end`, its one live step event (the loop's heap)."""

    @abstractmethod
    def _prefilled(self, wi: int, w: Worker, r: int, t: float) -> None:
        """P-worker wi's step ending at t finished request r's prompt: the hand-off."""

    def _admit(self, wi: int, w: Worker) -> None:
        """D-worker `w` admits its waiting legs FIFO within KV capacity and `max_seqs`; a
        prompt `w` is prefilling itself over several steps (`head_done`) holds one of the
        `max_seqs` places, as it joins the batch when its prefill ends."""
        prompt_lens, output_lens = self.prompt_lens, self.output_lens
        cap, max_seqs = self.lim[wi].kv_capacity, self.lim[wi].max_seqs
        if w.head_done:
            max_seqs -= 1
        while w.waiting and w.batch < max_seqs:
            r = w.waiting[0]
            need = prompt_lens[r] + output_lens[r]
            if w.kv_used + need > cap:
                if need > cap:  # can never fit
                    w.waiting.popleft()
                    self.failed[r] = True
                    w.load -= 1
                    continue
                break
            w.waiting.popleft()
            w.kv_used += need
            if w.caches is not None:  # the leg's KV is D's now: its prefix cache holds it
                w.caches.store(wi, r)
                w.caches.trim(wi, w.kv_used)
            replay = int(self.replay)  # a pulled leg's first step replays t1
            heapq.heappush(w.running, (w.steps + output_lens[r] - 1 + replay, r))
            self.decode_worker[r], self.join_step[r] = wi, w.steps + replay
            w.batch += 1
            w.context += prompt_lens[r] + 1 - replay
            w.new.append(r)
            if self.overlay.active:
                self.overlay.admitted(wi - self.npw, w.batch - 1)

    def cut_segment(self, wi: int, w: Worker, t: float) -> None:
        """End `w`'s decode-only segment at its next step boundary (the next step differs)."""
        if (end := w.cut_short(t)) is not None:
            self._schedule(wi, w, end)

    def _plan(self, wi: int, w: Worker, t: float) -> None:
        """Plan idle worker `w`'s next step at t: prompt chunks up to the token budget (a
        mixed step if it also decodes), else a decode-only segment (one step where the
        overlay's work or a pulled leg's replay makes it differ), else nothing."""
        w.chunks.clear()
        if w.queue:
            dropped = w.take_chunks(t, self.lim[wi], self.prompt_lens, self.output_lens,
                                    self.failed, self.prefill_start, self.charged)
            if w.role == PREFILL:  # a prompt that never fits P leaves its D's leg unsent
                for r in dropped:
                    if (d := self.decode_of[r]) >= 0:
                        self.D[d].load -= 1
        if w.role == PREFILL and self.overlay.active:
            self.overlay.prefilling(wi, bool(w.chunks), t)
        if w.chunks:
            first = w.start_chunk_step(t)
            end = t + first
        elif w.batch:
            first, end = self._decode_step(wi, w, t)
        else:  # nothing to run: wait, or wake when a transfer frees the KV its queue needs
            w.busy = False
            if w.role == DECODE and self.overlay.active:
                self.overlay.idle(wi - self.npw)
            if w.queue and w.kv_release:
                w.kind = KV_WAIT
                self._schedule(wi, w, w.kv_release[0][0])
            w.new.clear()
            return
        if self.replay:  # last step's joiners replayed t1: this step emits their t2
            w.joined.clear()
            w.joined, w.replaying = w.replaying, w.joined
            w.n_joined = len(w.new) + len(w.joined)
            local = self.local
            for r in w.new:  # a leg prefilled on D pulled nothing: it replays no t1
                (w.joined if local[r] else w.replaying).append(r)
        else:
            w.n_joined = len(w.new)
            w.joined, w.new = w.new, w.joined  # the joiners of the step now in progress
        for r in w.joined:
            self.t2[r] = t + first
        w.new.clear()
        self._schedule(wi, w, end)

    def _decode_step(self, wi: int, w: Worker, t: float) -> tuple[float, float]:
        """Start `w`'s decode-only work at t: a segment until its next request finishes (step
        k lasts α + β·k), or one step carrying the overlay's work or a pulled leg's replay.
        (The first step's duration, the end.)"""
        dc = w.decode_cost
        alpha = dc.a + dc.b * w.context + w.batch_term[w.batch]
        beta = dc.b * w.batch
        carry = None
        if w.role == DECODE and self.overlay.active:
            # invariant: a segment's steps all run at one pace (no overlay event in it)
            pace, carry = self.overlay.decode_step(wi - self.npw, w.batch)
            alpha, beta = alpha * pace, beta * pace
        if self.replay and w.new and carry is None:  # joiners replay t1: t2 comes next
            carry = 0.0
        if carry is not None:  # one step carrying the overlay's work
            w.kind, w.step_dur, w.started = STEP, alpha + carry, t
            return w.step_dur, t + w.step_dur
        k = w.running[0][0] - w.steps
        w.kind, w.started, w.alpha, w.beta = SEGMENT, t, alpha, beta
        w.seg_steps, w.cut = k, False
        return alpha, t + alpha * k + beta * k * (k - 1) / 2

    def _boundary(self, wi: int, w: Worker, t: float) -> None:
        """The step (or segment) in progress on `w` ends at `t`."""
        prompt_lens, output_lens = self.prompt_lens, self.output_lens
        if w.role == DECODE and self.overlay.active:
            self.overlay.step_ended(wi - self.npw)
        if w.kind == SEGMENT:
            k = w.seg_steps
            self.segs.append((w.alpha, w.beta, k, w.batch, w.n_joined, w.started, wi, w.steps))
            w.steps += k
            w.context += k * w.batch
        elif w.kind == STEP:
            if w.batch:
                self.segs.append((w.step_dur, 0.0, 1, w.batch, w.n_joined, w.started, wi, w.steps))
            w.steps += 1
            w.context += w.batch
            for r, q, p in w.chunks:
                if p + q < prompt_lens[r]:
                    continue
                if w.role == PREFILL:
                    self._prefilled(wi, w, r, t)
                    continue
                self.t1[r] = t
                if w.caches is not None:
                    w.caches.store(wi, r)
                if output_lens[r] == 1:
                    self.finish[r] = t
                    w.kv_used -= prompt_lens[r] + 1
                    w.load -= 1
                    if w.caches is not None:
                        w.caches.release(wi, r)
                else:
                    heapq.heappush(w.running, (w.steps + output_lens[r] - 1, r))
                    self.decode_worker[r], self.join_step[r] = wi, w.steps
                    w.batch += 1
                    w.context += prompt_lens[r] + 1
                    w.new.append(r)
            w.chunks.clear()
        run = w.running
        while run and run[0][0] <= w.steps:
            r = heapq.heappop(run)[1]
            self.finish[r] = t
            w.batch -= 1
            w.context -= prompt_lens[r] + output_lens[r]
            w.kv_used -= prompt_lens[r] + output_lens[r]
            w.load -= 1
            if w.caches is not None:
                w.caches.release(wi, r)
            if w.role == DECODE and w.batch and self.overlay.active:
                self.overlay.finished(wi - self.npw, w.batch)
        w.busy = False
        if w.waiting:
            self._admit(wi, w)
        self._plan(wi, w, t)

    def _poke(self, wi: int, w: Worker, t: float) -> None:
        """New work reached `w` at t: start it now if idle, else at the next step boundary."""
        if not w.busy:
            if w.waiting:
                self._admit(wi, w)
            self._plan(wi, w, t)
        else:
            self.cut_segment(wi, w, t)
