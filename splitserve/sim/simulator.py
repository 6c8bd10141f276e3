"""Discrete-event simulation of a splitserve deployment (router, P- and D-workers, KV links) or
of the colocated baselines (one engine doing both, with or without chunked prefill).

Workers step like vLLM's v1 scheduler: continuous batching, a token budget per step (decodes
first, one token each, then prompt chunks FIFO), KV capacity checked when a request is admitted
(its whole prompt + output is reserved; no preemption), at most `max_num_seqs` running
requests, requests arriving during a step join at the next step. A step's duration comes from
the profile's cost model.

Speed: while a worker only decodes and nothing arrives, its steps are deterministic, so it
advances to the next finishing request in one event (a *segment*: step k lasts
`α + β·k` with α = a + b·context + c·batch, β = b·batch); an arrival cuts the segment at the next
step boundary (solved from the quadratic). Per-step work is never a Python loop over the batch:
finishing requests come off a heap keyed by the absolute step they finish on.

Disaggregated flow: the router picks P and D on arrival (per policy); P's last prefill step
emits t1 (TTFT). splitserve's connector: the KV crosses the link while P prefills
(`model.transfer_arrival`); the leg joins D at max(t1 + router hop, KV arrival) and D's first
step emits t2. NIXL: D's next step after its leg reached it posts the READ (`model.pull_arrival`)
and its first step replays t1, so t2..tN come one step later. P holds the KV until the transfer
ends.

Effects beyond the workers' own step costs (e.g. router, client and workers sharing CPU cores:
`splitserve.sim.calibration`) enter only through the run's `Overlay` (`sim.overlay`), whose
hooks this loop calls at fixed points; with the null overlay this is the plain cluster model.
The KV hand-off from P to D, over either connector, is `sim.handoff`'s.
"""

from __future__ import annotations

import heapq

import numpy as np

from splitserve.sim.calibration.overlay import overlay_for
from splitserve.sim.deployment import Segment, SimConfig, SimOutcome, segment_arrays
from splitserve.sim.handoff import _EV_LEG, _EV_OVERLAY, _EV_STEP, Event, Handoff
from splitserve.sim.model import Profile
from splitserve.sim.overlay import Overlay
from splitserve.sim.routing import pick, pick_all
from splitserve.sim.workerstate import (
    COLOCATED,
    DECODE,
    KV_WAIT,
    PREFILL,
    SEGMENT,
    STEP,
    Worker,
    steps_done,
)
from splitserve.sim.workload import SimWorkload


class Simulation(Handoff):
    """One run of one workload on one deployment. `run()` returns a `SimOutcome`. The
    overlay (default: the null one) adds effects beyond the workers' own step costs."""

    def __init__(self, profile: Profile, config: SimConfig, workload: SimWorkload,
                 overlay: Overlay | None = None) -> None:
        self.profile, self.cfg, self.wl = profile, config, workload
        self.overlay = overlay if overlay is not None else Overlay()
        self.budget = config.token_budget or profile.token_budget
        self.cap = profile.kv_capacity_tokens
        self.max_seqs = profile.max_num_seqs
        pf, dc = profile.prefill, profile.decode
        jitter = self.overlay.gap_jitter_s
        self.jitter = profile.gap_jitter_s if jitter is None else jitter
        if config.mode == "disagg":
            self.link = profile.link(config.transport)
            p_pf, d_dc = self.overlay.prefill_cost(pf), self.overlay.decode_cost(dc)
            self.P = [Worker(PREFILL, p_pf, dc, self.max_seqs) for _ in range(config.n_prefill)]
            self.D = [Worker(DECODE, pf, d_dc, self.max_seqs) for _ in range(config.n_decode)]
        else:
            self.P = [Worker(COLOCATED, pf, dc, self.max_seqs) for _ in range(config.n_workers)]
            self.D = []
        self.W = self.P + self.D
        self.link_free = [0.0] * len(self.P)
        self.pull = config.mode == "disagg" and config.connector == "nixl"
        self.chunked = config.mode != "colocated"
        n = len(workload)
        self.arrivals = workload.arrivals.tolist()
        self.prompt_lens = workload.prompt_lens.tolist()
        self.output_lens = workload.output_lens.tolist()
        nan = float("nan")
        self.t1, self.t2, self.finish = [nan] * n, [nan] * n, [nan] * n
        self.prefill_start, self.kv_transfer = [nan] * n, [nan] * n
        self.failed = [False] * n
        self.decode_of, self.prefill_of = [0] * n, [0] * n
        self.heap: list[Event] = []
        self.seq = 0
        self.segs: list[Segment] = []
        self.decode_worker, self.join_step = [-1] * n, [0] * n
        self.shared_free = 0.0
        self.rng = np.random.default_rng(config.seed)
        self.overlay.bind(self)

    # worker mechanics ------------------------------------------------------------------
    def _push(self, t: float, kind: int, subject: int, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, subject, version))

    def _schedule(self, wi: int, w: Worker, end: float) -> None:
        w.version += 1
        w.busy = True
        self._push(end, _EV_STEP, wi, w.version)

    def _admit(self, wi: int, w: Worker) -> None:
        prompt_lens, output_lens, cap = self.prompt_lens, self.output_lens, self.cap
        while w.waiting and w.batch < self.max_seqs:
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
            replay = int(self.pull)  # a pulled leg's first step replays t1
            heapq.heappush(w.running, (w.steps + output_lens[r] - 1 + replay, r))
            self.decode_worker[r], self.join_step[r] = wi, w.steps + replay
            w.batch += 1
            w.context += prompt_lens[r] + 1 - replay
            w.new.append(r)
            if self.overlay.active:
                self.overlay.admitted(wi - len(self.P), w.batch - 1)

    # what an overlay may do to the run ------------------------------------------------
    def push_overlay_event(self, t: float, r: int) -> None:
        """Have the overlay's `overlay_event(r, t)` called at t."""
        self._push(t, _EV_OVERLAY, r, 0)

    def extend_step(self, wi: int, w: Worker, t: float, cost: float) -> None:
        """The step in progress on busy worker `w` at t takes `cost` seconds longer. A segment
        is split: its steps done by t stay a segment (recorded now), the one in progress
        becomes a step."""
        if (record := w.split_segment(t, wi)) is not None:
            self.segs.append(record)
        w.step_dur += cost
        for r in w.joined:  # t2 comes with this step's end
            self.t2[r] += cost
        self._schedule(wi, w, w.started + w.step_dur)

    def cut_segment(self, wi: int, w: Worker, t: float) -> None:
        """End `w`'s decode-only segment at its next step boundary (the next step differs)."""
        if w.busy and w.kind == SEGMENT and not w.cut:
            w.cut = True
            k = steps_done(w.alpha, w.beta, t - w.started) + 1
            if k < w.seg_steps:
                w.seg_steps = k
                self._schedule(wi, w, w.started + w.alpha * k + w.beta * k * (k - 1) / 2)

    def _plan(self, wi: int, w: Worker, t: float) -> None:
        pf, dc = w.prefill_cost, w.decode_cost
        chunks = w.chunks
        chunks.clear()
        if w.queue:
            rel = w.kv_release
            while rel and rel[0][0] <= t:
                w.kv_used -= heapq.heappop(rel)[1]
            budget = self.budget - w.batch
            prompt_lens, output_lens, cap = self.prompt_lens, self.output_lens, self.cap
            while w.queue and budget > 0:
                r = w.queue[0]
                done = w.head_done
                if done == 0:
                    if w.batch + len(chunks) >= self.max_seqs:
                        break
                    need = prompt_lens[r] + (output_lens[r] if w.role == COLOCATED else 0)
                    if need > cap:
                        w.queue.popleft()
                        self.failed[r] = True
                        w.load -= prompt_lens[r] if w.role == PREFILL else 1
                        continue
                    if w.kv_used + need > cap:
                        break
                rest = prompt_lens[r] - done
                if not self.chunked and rest > budget and chunks:
                    break
                q = rest if not self.chunked else min(rest, budget)
                if done == 0:
                    w.kv_used += need
                    self.prefill_start[r] = t
                chunks.append((r, q, done))
                budget -= q
                if q == rest:
                    w.queue.popleft()
                    w.head_done = 0
                else:
                    w.head_done = done + q
        if w.role == PREFILL and self.overlay.active:
            self.overlay.prefilling(wi, bool(chunks), t)
        if chunks:
            tok = sum(c[1] for c in chunks)
            quad = sum(q * q + 2 * p * q for _, q, p in chunks)
            dur = pf.time(tok, quad)
            if w.batch:  # a mixed step: one fixed cost (the larger), both variable parts
                dur += dc.b * w.context + w.batch_term[w.batch] + max(0.0, dc.a - pf.a)
            w.kind, w.step_dur, w.started, first = STEP, dur, t, dur
            end = t + dur
        elif w.batch:
            # a decode-only segment until the next request finishes: step k lasts α + β·k
            alpha = dc.a + dc.b * w.context + w.batch_term[w.batch]
            beta = dc.b * w.batch
            carry = None
            if w.role == DECODE and self.overlay.active:
                # invariant: a segment's steps all run at one pace (no overlay event in it)
                pace, carry = self.overlay.decode_step(wi - len(self.P), w.batch)
                alpha, beta = alpha * pace, beta * pace
            if self.pull and w.new and carry is None:  # joiners replay t1: t2 comes next
                carry = 0.0
            if carry is not None:  # one step carrying the overlay's work
                w.kind, w.step_dur, w.started = STEP, alpha + carry, t
                first = w.step_dur
                end = t + first
            else:
                k = w.running[0][0] - w.steps
                w.kind, w.started, w.alpha, w.beta = SEGMENT, t, alpha, beta
                w.seg_steps, w.cut = k, False
                end = t + alpha * k + beta * k * (k - 1) / 2
                first = alpha
        else:
            w.busy = False
            if w.role == DECODE and self.overlay.active:
                self.overlay.idle(wi - len(self.P))
            if w.queue and w.kv_release:  # blocked on KV that a transfer still holds
                w.kind = KV_WAIT
                self._schedule(wi, w, w.kv_release[0][0])
            w.new.clear()
            return
        if self.pull:  # last step's joiners replayed t1: this step emits their t2
            w.joined.clear()
            w.joined, w.replaying = w.replaying, w.joined
            w.n_joined = len(w.new) + len(w.joined)
            w.replaying.extend(w.new)
        else:
            w.n_joined = len(w.new)
            w.joined, w.new = w.new, w.joined  # the joiners of the step now in progress
        for r in w.joined:
            self.t2[r] = t + first
        w.new.clear()
        self._schedule(wi, w, end)

    def _boundary(self, wi: int, w: Worker, t: float) -> None:
        """The step (or segment) in progress on `w` ends at `t`."""
        prompt_lens, output_lens = self.prompt_lens, self.output_lens
        if w.role == DECODE and self.overlay.active:
            self.overlay.step_ended(wi - len(self.P))
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
                if output_lens[r] == 1:
                    self.finish[r] = t
                    w.kv_used -= prompt_lens[r] + 1
                    w.load -= 1
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
            if w.role == DECODE and w.batch and self.overlay.active:
                self.overlay.finished(wi - len(self.P), w.batch)
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

    def run(self) -> SimOutcome:
        cfg, n = self.cfg, len(self.arrivals)
        shape = self.profile.model
        self.kvbpt, self.layers = shape.kv_bytes_per_token, shape.layers
        P, D, W = self.P, self.D, self.W
        npw = len(P)
        two_p = [self.rng.integers(0, len(P), size=n).tolist() for _ in range(2)]
        pre_p = pick_all(self.rng, P, cfg.p_policy, n, prompt_lens=self.prompt_lens,
                         kv_capacity=self.cap)
        if D:
            two_d = [self.rng.integers(0, len(D), size=n).tolist() for _ in range(2)]
            pre_d = pick_all(self.rng, D, cfg.d_policy, n, prompt_lens=self.prompt_lens,
                             kv_capacity=self.cap)
        heap, arrivals = self.heap, self.arrivals
        prompt_lens, output_lens = self.prompt_lens, self.output_lens
        pop = heapq.heappop
        i, events = 0, 0
        inf = float("inf")
        while i < n or heap:
            ta = arrivals[i] if i < n else inf
            if heap and heap[0][0] < ta:
                t, _, kind, subject, version = pop(heap)
                events += 1
                if kind == _EV_STEP:
                    w = W[subject]
                    if version != w.version:
                        continue
                    if w.kind == KV_WAIT:
                        w.busy = False
                        w.kind = STEP
                        self._plan(subject, w, t)
                    else:
                        self._boundary(subject, w, t)
                elif kind == _EV_OVERLAY:
                    self.overlay.overlay_event(subject, t)
                elif kind == _EV_LEG:
                    self._post_read(subject, t)
                else:  # decode leg reaches D
                    di = self.decode_of[subject]
                    w = D[di]
                    w.waiting.append(subject)
                    self._poke(npw + di, w, t)
                continue
            r, i = i, i + 1
            events += 1
            p = pick(P, cfg.p_policy, pre_p, r, two_p)
            w = P[p]
            w.queue.append(r)
            if D:
                w.load += prompt_lens[r]
                if output_lens[r] > 1:
                    d = pick(D, cfg.d_policy, pre_d, r, two_d)
                    self.decode_of[r] = d
                    D[d].load += 1
                    if self.overlay.active:
                        self.overlay.arrived(d, ta)
            else:
                w.load += 1
            self._poke(p, w, ta)
        return self._outcome(events)

    def _outcome(self, events: int) -> SimOutcome:
        f = np.asarray
        return SimOutcome(
            arrivals=self.wl.arrivals, prompt_lens=self.wl.prompt_lens,
            output_lens=self.wl.output_lens, first_token=f(self.t1), second_token=f(self.t2),
            finish=f(self.finish), failed=f(self.failed, dtype=bool),
            **segment_arrays(self.segs), decode_worker=f(self.decode_worker),
            join_step=f(self.join_step), kv_transfer_s=f(self.kv_transfer), events=events,
            gap_jitter_s=self.jitter,
        )


def simulate(profile: Profile, config: SimConfig, workload: SimWorkload) -> SimOutcome:
    """Run `workload` on the deployment `config` describes, with the profile's overlay (its
    shared-core costs, where it carries them and the config applies them)."""
    return Simulation(profile, config, workload, overlay_for(profile, config)).run()
