"""The simulator's overlay for a disaggregated deployment whose router, client and workers share
a few CPU cores: a profile's `split` costs (`SplitCost`) applied through `sim.overlay`'s hooks.

- P's steps × `prefill_factor`; D steps with the decode cost measured through the router;
- t1 += `router_request_s`, and += `t1_relay_s` when the request's D runs streams then;
- the leg joins D no earlier than t1 + hop + `handover_a_s + handover_b_s·prompt`;
- D j shares its host's cores with P (j mod n_P): D's steps that start while that P prefills
  take `1 + stretch` times as long;
- each request event puts its seconds on its D's steps: t1's on the step in progress, the
  arrival's and the end's on the next, the join's on the joiner's first step, its t2 relay on
  the step after; while D runs no streams they cost nothing (nobody waits on that step).
  Stretching by P's state at a step's start, not by overlap, gives the same stretched time in
  expectation (measured: 12.4 vs 12.5 % and 24.8 vs 25.1 % of D's time at 1 and 2 req/s).
"""

from __future__ import annotations

from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.costmodel import DecodeCost, PrefillCost
from splitserve.sim.overlay import Leg, Overlay, RunControl

# fields of a `SplitCost.terms` row: D's stretch while its P prefills, each event's seconds
_STRETCH, _ARRIVE, _T1, _JOIN, _FINISH, _T2 = range(6)


class SharedCoreOverlay(Overlay):
    """`split` on a deployment of `n_prefill` P and `n_decode` D workers, with at most
    `max_seqs` streams per D."""

    active = True

    def __init__(self, split: SplitCost, n_prefill: int, n_decode: int, max_seqs: int) -> None:
        self.split, self.n_prefill, self.n_decode = split, n_prefill, n_decode
        self.gap_jitter_s = split.gap_jitter_s
        self.router_s, self.relay_s = split.router_request_s, split.t1_relay_s
        self.hand_a, self.hand_b = split.handover_a_s, split.handover_b_s
        # D's terms (SplitCost.terms) by D's other streams, 0..max_seqs
        self.terms = split.term_table(max_seqs)
        self.stretches = any(x[_STRETCH] > 0.0 for x in self.terms)
        self.t1_costs = any(x[_T1] > 0.0 for x in self.terms)
        # per D: seconds of other processes' work to add to its next step, and to the step
        # after that (the relay of its joiners' t2)
        self.extra = [0.0] * n_decode
        self.after = [0.0] * n_decode
        self.p_busy = [False] * n_prefill  # per P: its current step prefills
        self.run: RunControl | None = None

    def bind(self, run: RunControl) -> None:
        self.run = run

    def prefill_cost(self, base: PrefillCost) -> PrefillCost:
        return self.split.p_prefill(base)

    def decode_cost(self, base: DecodeCost) -> DecodeCost:
        return self.split.decode  # measured through the router: replaces the plain worker's

    def t1(self, at: float, leg: Leg) -> float:
        t1 = at + self.router_s
        if self.relay_s:  # the relay waits while the D on the router's cores runs streams
            d = leg.decode if leg.decode is not None else leg.prefill % self.n_decode
            t1 += self.relay_s if self._run.decode_batch(d) else 0.0
        return t1

    def join_ready(self, at: float, leg: Leg) -> float:
        return at + self.hand_a + self.hand_b * leg.prompt_len

    @property
    def _run(self) -> RunControl:
        assert self.run is not None, "bind() comes before the run"
        return self.run

    def _charge(self, d: int, term: int, t: float) -> None:
        """A request event at t puts its seconds (`terms[B][term]`, B = D's streams) of other
        work on D-worker d's core: t1's on the step in progress (the router's relay of t1 and
        the decode leg's arrival at D overlap it), the others' on its next step (dropped while
        D runs no streams: nobody waits on that step)."""
        run = self._run
        batch = run.decode_batch(d)
        cost = self.terms[batch][term]
        if cost > 0.0 and batch:
            if term == _T1 and run.decode_busy(d):  # a busy D runs a step or a segment
                run.extend_decode_step(d, t, cost)
            else:
                self.extra[d] += cost
                run.cut_decode_segment(d, t)

    def arrived(self, d: int, t: float) -> None:
        self._charge(d, _ARRIVE, t)

    def t1_emitted(self, leg: Leg, t1: float) -> None:
        if self.t1_costs and leg.decode is not None:  # t1's work on D's core: at its relay
            self._run.push_overlay_event(t1, leg.decode)

    def overlay_event(self, key: int, t: float) -> None:
        self._charge(key, _T1, t)  # key: the D-worker of the request whose t1 was relayed

    def admitted(self, d: int, others: int) -> None:
        self.extra[d] += self.terms[others][_JOIN]  # the join's work, on D's next step
        self.after[d] += self.terms[others][_T2]  # its t2's relay, on the step after that

    def finished(self, d: int, batch: int) -> None:
        self.extra[d] += self.terms[batch][_FINISH]

    def prefilling(self, p: int, busy: bool, t: float) -> None:
        if self.stretches and self.p_busy[p] != busy:
            self.p_busy[p] = busy  # D-workers on this P's cores step at another pace
            run = self._run
            for j in range(p, self.n_decode, self.n_prefill):
                run.cut_decode_segment(j, t)

    def decode_step(self, d: int, batch: int) -> tuple[float, float | None]:
        busy = self.p_busy[d % self.n_prefill]
        pace = 1.0 + self.terms[batch][_STRETCH] if busy else 1.0
        if self.extra[d] > 0.0 or self.after[d] > 0.0:  # one step carrying the events' work
            carry, self.extra[d] = self.extra[d], 0.0
            return pace, carry
        return pace, None

    def step_ended(self, d: int) -> None:
        # invariant: `after` was added at the admissions just before the step ending now (a
        # single step: `decode_step`), so it lands on the next one
        self.extra[d] += self.after[d]
        self.after[d] = 0.0

    def idle(self, d: int) -> None:
        self.extra[d] = self.after[d] = 0.0

