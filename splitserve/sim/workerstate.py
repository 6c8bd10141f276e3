"""One simulated worker's state (`Worker`) and the closed form of a decode-only segment
(`steps_done`); the mechanics that move it live in `simulator.py`."""

from __future__ import annotations

import math
from collections import deque

from splitserve.sim.deployment import Segment
from splitserve.sim.model import DecodeCost, PrefillCost

P, D, BOTH = 0, 1, 2  # roles
STEP, SEG, WAIT = 0, 1, 2  # what a busy worker is doing


class Worker:
    __slots__ = ("role", "queue", "head_done", "waiting", "running", "B", "C", "S", "busy",
                 "kind", "t0", "alpha", "beta", "k", "cut", "ver", "kv_used", "kv_release",
                 "load", "chunks", "new", "nnew", "step_dur", "pf", "dc", "joined", "bterm")

    def __init__(self, role: int, pf: PrefillCost, dc: DecodeCost, max_seqs: int) -> None:
        self.role, self.pf, self.dc = role, pf, dc
        # dc.batch_term(B) for B = 0..max_seqs: looked up on every step, computed once
        self.bterm = [dc.batch_term(b) for b in range(max_seqs + 1)]
        self.queue: deque[int] = deque()
        self.head_done = 0
        self.waiting: deque[int] = deque()
        self.running: list[tuple[int, int]] = []
        self.B = self.S = self.k = self.ver = self.kv_used = self.load = self.nnew = 0
        self.C = 0
        self.busy = self.cut = False
        self.kind = STEP
        self.t0 = self.alpha = self.beta = self.step_dur = 0.0
        self.kv_release: list[tuple[float, int]] = []
        self.chunks: list[tuple[int, int, int]] = []
        self.new: list[int] = []
        self.joined: list[int] = []  # the requests whose t2 the step in progress emits

    def split_segment(self, t: float, wi: int) -> Segment | None:
        """Make the step in progress at t a step of its own (it is about to change): a
        segment's steps done by t are left behind as a segment, returned as its record for the
        run's `segs` (None: none done, or no segment in progress; `wi`: this worker's index)."""
        if self.kind != SEG:
            return None
        done = min(steps_done(self.alpha, self.beta, t - self.t0), self.k - 1)
        t0 = self.t0 + self.alpha * done + self.beta * done * (done - 1) / 2
        record = None
        if done:
            record = (self.alpha, self.beta, done, self.B, self.nnew, self.t0, wi, self.S)
            self.S += done
            self.C += done * self.B
            self.nnew = 0
            self.joined.clear()  # their t2 came with the segment's first step
        self.kind, self.step_dur = STEP, self.alpha + self.beta * done
        self.t0 = t0
        return record


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
