"""Discrete-event simulation of a splitserve deployment (router, P- and D-workers, KV links) or
of the colocated baselines (one engine doing both, with or without chunked prefill).

Workers step like vLLM's v1 scheduler: continuous batching, a token budget per step (decodes
first, one token each, then prompt chunks FIFO), KV capacity checked when a request is admitted
(its whole prompt + output is reserved; no preemption), at most `max_num_seqs` running
requests, requests arriving during a step join at
the next step. A step's duration comes from the profile's cost model.

Speed: while a worker only decodes and nothing arrives, its steps are deterministic, so it
advances to the next finishing request in one event (a *segment*: step k lasts
`α + β·k` with α = a + b·context + c·batch, β = b·batch); an arrival cuts the segment at the next
step boundary (solved from the quadratic). Per-step work is never a Python loop over the batch:
finishing requests come off a heap keyed by the absolute step they finish on.

Disaggregated flow: the router picks P and D on arrival (per policy); P's last prefill step
emits t1 (TTFT); the KV crosses the link (`model.transfer_arrival`); the decode leg joins D at
max(t1 + router hop, KV arrival) and produces t2..tN; P holds the prompt's KV until the transfer
ends. The profile's `split` costs (`model.SplitCost`; the README's "Simulator semantics" says
where each lands) scale P's steps, add the router's time to t1 and the handover to the join,
give D its step cost through the router, stretch every step by the CPU taken per request at
the offered rate, stretch D j's steps that start while its P (j mod n_P) prefills, and put each
request event's seconds on its D's steps: t1's on the step in progress, the arrival's and the
end's on the next, the join's on the joiner's first step, its t2 relay on the step after.
Stretching by P's state at a step's start, not by overlap, gives the same stretched time in
expectation (measured: 12.4 vs 12.5 % and 24.8 vs 25.1 % of D's time at 1 and 2 req/s).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from splitserve.sim.deployment import Segment, SimConfig, SimOutcome, segment_arrays
from splitserve.sim.model import Profile, transfer_arrival
from splitserve.sim.routing import pick, pick_all
from splitserve.sim.workerstate import BOTH as _BOTH
from splitserve.sim.workerstate import SEG as _SEG
from splitserve.sim.workerstate import STEP as _STEP
from splitserve.sim.workerstate import WAIT as _WAIT
from splitserve.sim.workerstate import D as _D
from splitserve.sim.workerstate import P as _P
from splitserve.sim.workerstate import Worker as _Worker
from splitserve.sim.workerstate import steps_done as _steps_done
from splitserve.sim.workload import SimWorkload

_EV_STEP, _EV_JOIN, _EV_T1 = 0, 1, 2
# fields of a `SplitCost.terms` row: D's stretch while its P prefills, each event's seconds
_STRETCH, _ARRIVE, _T1, _JOIN, _FINISH, _T2 = range(6)


class Simulation:
    """One run of one workload on one deployment. `run()` returns a `SimOutcome`."""

    def __init__(self, profile: Profile, config: SimConfig, workload: SimWorkload) -> None:
        self.profile, self.cfg, self.wl = profile, config, workload
        self.budget = config.token_budget or profile.token_budget
        self.cap = profile.kv_capacity_tokens
        self.max_seqs = profile.max_num_seqs
        pf, dc = profile.prefill, profile.decode
        split = profile.split if config.mode == "disagg" and config.split_costs else None
        self.router_s, self.hand_a, self.hand_b = 0.0, 0.0, 0.0
        self.relay_s = split.t1_relay_s if split is not None else 0.0
        self.noise = split.gap_noise if split is not None else ()
        self.jitter = split.gap_jitter_s if split is not None else profile.gap_jitter_s
        # D's interference terms (SplitCost.terms) by D's other streams, 0..max_num_seqs:
        # (stretch while its P prefills, arrive, t1, join, finish, t2 seconds)
        zero = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.iterm = (split.term_table(self.max_seqs) if split is not None
                      else [zero] * (self.max_seqs + 1))
        self.stretches = any(x[_STRETCH] > 0.0 for x in self.iterm)
        self.t1_costs = any(x[_T1] > 0.0 for x in self.iterm)
        if config.mode == "disagg":
            self.link = profile.link(config.transport)
            p_pf, d_dc = pf, dc
            if split is not None:
                rate = workload.offered_rate if math.isfinite(workload.offered_rate) else 0.0
                p_pf = split.p_prefill(pf, rate / config.n_prefill)
                d_dc = split.d_decode(rate / config.n_decode)
                k = split.stretch(rate / config.n_decode, split.cpu_d_s)
                self.router_s = split.router_request_s
                self.hand_a, self.hand_b = split.handover_a_s * k, split.handover_b_s * k
            self.P = [_Worker(_P, p_pf, dc, self.max_seqs) for _ in range(config.n_prefill)]
            self.D = [_Worker(_D, pf, d_dc, self.max_seqs) for _ in range(config.n_decode)]
            for j, d in enumerate(self.D):  # D j shares its host's cores with P (j mod n_P)
                d.mate = j % config.n_prefill
        else:
            self.P = [_Worker(_BOTH, pf, dc, self.max_seqs) for _ in range(config.n_workers)]
            self.D = []
        self.W = self.P + self.D
        self.link_free = [0.0] * len(self.P)
        self.chunked = config.mode != "colocated"
        n = len(workload)
        self.arr = workload.arrivals.tolist()
        self.pl = workload.prompt_lens.tolist()
        self.ol = workload.output_lens.tolist()
        nan = float("nan")
        self.t1, self.t2, self.tend = [nan] * n, [nan] * n, [nan] * n
        self.pstart, self.xfer = [nan] * n, [nan] * n
        self.failed = [False] * n
        self.dsel = [0] * n
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.segs: list[Segment] = []
        self.wdec, self.jstep = [-1] * n, [0] * n
        self.shared_free = 0.0
        self.rng = np.random.default_rng(config.seed)

    # worker mechanics ------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _schedule(self, wi: int, w: _Worker, end: float) -> None:
        w.ver += 1
        w.busy = True
        self._push(end, _EV_STEP, wi, w.ver)

    def _admit(self, wi: int, w: _Worker) -> None:
        pl, ol, cap = self.pl, self.ol, self.cap
        while w.waiting and w.B < self.max_seqs:
            r = w.waiting[0]
            need = pl[r] + ol[r]
            if w.kv_used + need > cap:
                if need > cap:  # can never fit
                    w.waiting.popleft()
                    self.failed[r] = True
                    w.load -= 1
                    continue
                break
            w.waiting.popleft()
            w.kv_used += need
            heapq.heappush(w.running, (w.S + ol[r] - 1, r))
            self.wdec[r], self.jstep[r] = wi, w.S
            w.B += 1
            w.C += pl[r] + 1
            w.new.append(r)
            w.extra += self.iterm[w.B - 1][_JOIN]  # the join's work, on D's next step
            w.after += self.iterm[w.B - 1][_T2]  # its t2's relay, on the step after that

    def _charge(self, di: int, term: int, t: float) -> None:
        """A request event at t puts its seconds (`iterm[B][term]`, B = D's streams) of other
        work on D-worker di's core: t1's on the step in progress (`_extend`; the router's relay
        of t1 and the decode leg's arrival at D overlap it), the others' on its next step
        (dropped while D runs no streams: nobody waits on that step)."""
        w = self.D[di]
        cost = self.iterm[w.B][term]
        if cost > 0.0 and w.B:
            if term == _T1 and w.busy:  # a busy D runs a step or a segment (never waits)
                self._extend(len(self.P) + di, w, t, cost)
            else:
                w.extra += cost
                self._cut(len(self.P) + di, w, t)

    def _extend(self, wi: int, w: _Worker, t: float, cost: float) -> None:
        """The step in progress on `w` at t takes `cost` seconds longer. A segment is split: its
        steps done by t stay a segment (recorded now), the one in progress becomes a step."""
        if (record := w.split_segment(t, wi)) is not None:
            self.segs.append(record)
        w.step_dur += cost
        for r in w.joined:  # t2 comes with this step's end
            self.t2[r] += cost
        self._schedule(wi, w, w.t0 + w.step_dur)

    def _cut(self, wi: int, w: _Worker, t: float) -> None:
        """End `w`'s decode-only segment at its next step boundary (the next step differs)."""
        if w.busy and w.kind == _SEG and not w.cut:
            w.cut = True
            k = _steps_done(w.alpha, w.beta, t - w.t0) + 1
            if k < w.k:
                w.k = k
                self._schedule(wi, w, w.t0 + w.alpha * k + w.beta * k * (k - 1) / 2)

    def _plan(self, wi: int, w: _Worker, t: float) -> None:
        pf, dc = w.pf, w.dc
        chunks = w.chunks
        chunks.clear()
        if w.queue:
            rel = w.kv_release
            while rel and rel[0][0] <= t:
                w.kv_used -= heapq.heappop(rel)[1]
            budget = self.budget - w.B
            pl, ol, cap = self.pl, self.ol, self.cap
            while w.queue and budget > 0:
                r = w.queue[0]
                done = w.head_done
                if done == 0:
                    if w.B + len(chunks) >= self.max_seqs:
                        break
                    need = pl[r] + (ol[r] if w.role == _BOTH else 0)
                    if need > cap:
                        w.queue.popleft()
                        self.failed[r] = True
                        w.load -= pl[r] if w.role == _P else 1
                        continue
                    if w.kv_used + need > cap:
                        break
                rest = pl[r] - done
                if not self.chunked and rest > budget and chunks:
                    break
                q = rest if not self.chunked else min(rest, budget)
                if done == 0:
                    w.kv_used += need
                    self.pstart[r] = t
                chunks.append((r, q, done))
                budget -= q
                if q == rest:
                    w.queue.popleft()
                    w.head_done = 0
                else:
                    w.head_done = done + q
        if w.role == _P and self.stretches and w.prefilling != bool(chunks):
            w.prefilling = bool(chunks)  # D-workers on this P's cores step at another pace
            npw = len(self.P)
            for j in range(wi, len(self.D), npw):
                self._cut(npw + j, self.D[j], t)
        if chunks:
            tok = sum(c[1] for c in chunks)
            quad = sum(q * q + 2 * p * q for _, q, p in chunks)
            dur = pf.time(tok, quad)
            if w.B:  # a mixed step: one fixed cost (the larger), both variable parts
                dur += dc.b * w.C + w.bterm[w.B] + max(0.0, dc.a - pf.a)
            w.kind, w.step_dur, w.t0, first = _STEP, dur, t, dur
            end = t + dur
        elif w.B:
            # invariant: a segment's steps all run at one pace (P's state, no events)
            busy = w.role == _D and self.P[w.mate].prefilling
            pace = 1.0 + self.iterm[w.B][_STRETCH] if busy else 1.0
            alpha = (dc.a + dc.b * w.C + w.bterm[w.B]) * pace
            if w.extra > 0.0 or w.after > 0.0:  # one step carrying the events' work
                w.kind, w.step_dur, w.t0 = _STEP, alpha + w.extra, t
                w.extra = 0.0
                first = w.step_dur
                end = t + first
            else:
                k = w.running[0][0] - w.S
                beta = dc.b * w.B * pace
                w.kind, w.t0, w.alpha, w.beta, w.k, w.cut = _SEG, t, alpha, beta, k, False
                end = t + alpha * k + beta * k * (k - 1) / 2
                first = alpha
        else:
            w.busy = False
            w.extra = w.after = 0.0  # work charged to a step that never runs: nobody waits
            if w.queue and w.kv_release:  # blocked on KV that a transfer still holds
                w.kind = _WAIT
                self._schedule(wi, w, w.kv_release[0][0])
            w.new.clear()
            return
        for r in w.new:
            self.t2[r] = t + first
        w.nnew = len(w.new)
        w.joined, w.new = w.new, w.joined  # the joiners of the step now in progress
        w.new.clear()
        self._schedule(wi, w, end)

    def _boundary(self, wi: int, w: _Worker, t: float) -> None:
        """The step (or segment) in progress on `w` ends at `t`."""
        pl, ol = self.pl, self.ol
        # invariant: `after` was added at the admissions just before the step ending now (a
        # single step: `_plan`), so it lands on the next one
        w.extra += w.after
        w.after = 0.0
        if w.kind == _SEG:
            k = w.k
            self.segs.append((w.alpha, w.beta, k, w.B, w.nnew, w.t0, wi, w.S))
            w.S += k
            w.C += k * w.B
        elif w.kind == _STEP:
            if w.B:
                self.segs.append((w.step_dur, 0.0, 1, w.B, w.nnew, w.t0, wi, w.S))
            w.S += 1
            w.C += w.B
            for r, q, p in w.chunks:
                if p + q < pl[r]:
                    continue
                if w.role == _P:
                    self._prefilled(wi, w, r, t)
                    continue
                self.t1[r] = t
                if ol[r] == 1:
                    self.tend[r] = t
                    w.kv_used -= pl[r] + 1
                    w.load -= 1
                else:
                    heapq.heappush(w.running, (w.S + ol[r] - 1, r))
                    self.wdec[r], self.jstep[r] = wi, w.S
                    w.B += 1
                    w.C += pl[r] + 1
                    w.new.append(r)
            w.chunks.clear()
        run = w.running
        while run and run[0][0] <= w.S:
            r = heapq.heappop(run)[1]
            self.tend[r] = t
            w.B -= 1
            w.C -= pl[r] + ol[r]
            w.kv_used -= pl[r] + ol[r]
            w.load -= 1
            if w.role == _D and w.B:
                w.extra += self.iterm[w.B][_FINISH]
        w.busy = False
        if w.waiting:
            self._admit(wi, w)
        self._plan(wi, w, t)

    def _prefilled(self, wi: int, w: _Worker, r: int, t: float) -> None:
        """P finished request r's prompt at t: emit t1, start the KV transfer."""
        hop = self.cfg.router_hop_s
        t1 = t + hop + self.router_s
        if self.relay_s:  # the relay waits while the D on the router's cores runs streams
            d = self.dsel[r] if self.ol[r] > 1 else wi % len(self.D)
            t1 += self.relay_s if self.D[d].B else 0.0
        self.t1[r] = t1
        w.load -= self.pl[r]
        if self.ol[r] == 1:
            self.tend[r] = t1
            w.kv_used -= self.pl[r]
            return
        nbytes = self.kvbpt * self.pl[r]
        free = self.shared_free if self.cfg.shared_link else self.link_free[wi]
        arrive, free = transfer_arrival(self.link, nbytes, self.layers, self.pstart[r], t,
                                        self.cfg.overlap, free)
        if self.cfg.shared_link:
            self.shared_free = free
        else:
            self.link_free[wi] = free
        heapq.heappush(w.kv_release, (free, self.pl[r]))
        self.xfer[r] = arrive - t
        if self.t1_costs:  # t1's work on D's core comes when the router relays t1
            self._push(t1, _EV_T1, r, 0)
        ready = t1 + hop + self.hand_a + self.hand_b * self.pl[r]
        self._push(max(arrive, ready), _EV_JOIN, r, 0)

    def _poke(self, wi: int, w: _Worker, t: float) -> None:
        """New work reached `w` at t: start it now if idle, else at the next step boundary."""
        if not w.busy:
            if w.waiting:
                self._admit(wi, w)
            self._plan(wi, w, t)
        else:
            self._cut(wi, w, t)

    def run(self) -> SimOutcome:
        cfg, n = self.cfg, len(self.arr)
        shape = self.profile.model
        self.kvbpt, self.layers = shape.kv_bytes_per_token, shape.layers
        P, D, W = self.P, self.D, self.W
        npw = len(P)
        two_p = [self.rng.integers(0, len(P), size=n).tolist() for _ in range(2)]
        pre_p = pick_all(self.rng, P, cfg.p_policy, n)
        if D:
            two_d = [self.rng.integers(0, len(D), size=n).tolist() for _ in range(2)]
            pre_d = pick_all(self.rng, D, cfg.d_policy, n)
        heap, arr, pl, ol = self.heap, self.arr, self.pl, self.ol
        pop = heapq.heappop
        i, events = 0, 0
        inf = float("inf")
        while i < n or heap:
            ta = arr[i] if i < n else inf
            if heap and heap[0][0] < ta:
                t, _, kind, a, b = pop(heap)
                events += 1
                if kind == _EV_STEP:
                    w = W[a]
                    if b != w.ver:
                        continue
                    if w.kind == _WAIT:
                        w.busy = False
                        w.kind = _STEP
                        self._plan(a, w, t)
                    else:
                        self._boundary(a, w, t)
                elif kind == _EV_T1:
                    self._charge(self.dsel[a], _T1, t)
                else:  # decode leg reaches D
                    di = self.dsel[a]
                    w = D[di]
                    w.waiting.append(a)
                    self._poke(npw + di, w, t)
                continue
            r, i = i, i + 1
            events += 1
            p = pick(P, cfg.p_policy, pre_p, r, two_p)
            w = P[p]
            w.queue.append(r)
            if D:
                w.load += pl[r]
                if ol[r] > 1:
                    d = pick(D, cfg.d_policy, pre_d, r, two_d)
                    self.dsel[r] = d
                    D[d].load += 1
                    self._charge(d, _ARRIVE, ta)
            else:
                w.load += 1
            self._poke(p, w, ta)
        return self._outcome(events)

    def _outcome(self, events: int) -> SimOutcome:
        f = np.asarray
        return SimOutcome(
            arrivals=self.wl.arrivals, prompt_lens=self.wl.prompt_lens,
            output_lens=self.wl.output_lens, first_token=f(self.t1), second_token=f(self.t2),
            finish=f(self.tend), failed=f(self.failed, dtype=bool),
            **segment_arrays(self.segs), decode_worker=f(self.wdec), join_step=f(self.jstep),
            kv_transfer_s=f(self.xfer), events=events, gap_noise=self.noise,
            gap_jitter_s=self.jitter,
        )


def simulate(profile: Profile, config: SimConfig, workload: SimWorkload) -> SimOutcome:
    return Simulation(profile, config, workload).run()
