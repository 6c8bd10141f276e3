"""What a disaggregated deployment on shared CPU cores costs beyond its workers' plain step
times (`SplitCost`, a profile's optional `split` section), as the simulator's overlay applies it
(`calibration.overlay`) and `calibration.calibrate` measures it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.sim.costmodel import (
    Bins,
    DecodeCost,
    PrefillCost,
    check_bins,
    check_finite_nonneg,
    parse_bins,
)


@dataclass(frozen=True)
class SplitCost:
    """What a disaggregated deployment costs beyond its workers' plain step times.

    - `router_request_s`: added to TTFT (client → router → P → router → client, beyond P's
      prefill);
    - `prefill_factor`: P's prefill steps relative to the profile's (the connector's sender
      thread gathers and pushes KV on P's core);
    - `handover_a_s + handover_b_s·prompt_len`: from t1 at the client to D's leg joining D's
      batch (router work, KV load, D's admission); D's first step comes on top;
    - `decode`: D's step cost as the client sees it through the router (replaces the profile's
      decode cost on D-workers);
    - `p_busy_stretch`: D's decode steps take `1 + p_busy_stretch` times as long while its P
      (the P it shares cores with) is prefilling: P's engine then saturates its core and the
      router, client and API servers all run on D's;
    - `arrive_s`, `t1_s`, `join_s`, `finish_s`: seconds each request's events (arrival at the
      router, its first token t1, its leg joining D, its end) add to the step its D-worker is
      running then (the router's, the API servers' and the client's burst of work per event,
      landing on D's core). `join_s` is part of D's first step for the joining request (its
      join step), so the calibrated handover excludes it; `t2_s` is the relay of that step's
      token t2 (D's API server → router → client), on D's step after the join step;
    - `t1_relay_s`: seconds t1 waits for the router's relay when the request's D-worker runs
      streams then (the router and the client share D's cores: a lone request never waits;
      `calibrate` fits it to a loaded stream's median TTFT);
    - `interference`: the six terms above measured at several batch sizes, rows
      `(others, p_busy_stretch, arrive_s, t1_s, join_s, finish_s, t2_s)` by increasing
      `others`, the number of D's streams other than the event's request (for the stretch: D's
      streams). When present it replaces the six scalars (which then hold the first row):
      `terms(others)` interpolates linearly between rows and holds the end rows' values
      outside them;
    - `gap_jitter_s`: the client's decode gaps around D's pace through the router, as (seconds
      added, weight per mille) bins (`calibration.jitter`); replaces the profile's own.
    """

    router_request_s: float
    prefill_factor: float
    handover_a_s: float
    handover_b_s: float
    decode: DecodeCost
    p_busy_stretch: float = 0.0
    arrive_s: float = 0.0
    t1_s: float = 0.0
    join_s: float = 0.0
    finish_s: float = 0.0
    t2_s: float = 0.0
    t1_relay_s: float = 0.0
    gap_jitter_s: Bins = ()
    interference: tuple[tuple[float, ...], ...] = ()
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_finite_nonneg("SplitCost", router_request_s=self.router_request_s,
                       prefill_factor=self.prefill_factor, handover_a_s=self.handover_a_s,
                       handover_b_s=self.handover_b_s, p_busy_stretch=self.p_busy_stretch,
                       arrive_s=self.arrive_s, t1_s=self.t1_s, join_s=self.join_s,
                       finish_s=self.finish_s, t2_s=self.t2_s, t1_relay_s=self.t1_relay_s)
        if self.prefill_factor <= 0:
            raise ValueError("SplitCost.prefill_factor must be > 0")
        check_bins("SplitCost", self.gap_jitter_s)
        for row in self.interference:
            if len(row) != 7 or not all(math.isfinite(v) and v >= 0 for v in row):
                raise ValueError(f"SplitCost.interference rows are 7 numbers >= 0: {row}")
        object.__setattr__(self, "interference", tuple(tuple(row) for row in self.interference))
        if any(a[0] >= b[0] for a, b in zip(self.interference, self.interference[1:],
                                             strict=False)):
            raise ValueError("SplitCost.interference rows must have increasing batch sizes")

    @property
    def events(self) -> tuple[float, float, float, float, float]:
        """(arrive_s, t1_s, join_s, finish_s, t2_s)."""
        return self.arrive_s, self.t1_s, self.join_s, self.finish_s, self.t2_s

    def terms(self, others: float) -> tuple[float, float, float, float, float, float]:
        """(p_busy_stretch, arrive_s, t1_s, join_s, finish_s, t2_s) with `others` other streams
        on D: the `interference` rows interpolated linearly, held constant beyond the end rows;
        the scalars when there are no rows."""
        rows = self.interference
        if not rows:
            return (self.p_busy_stretch, *self.events)
        lo, hi = rows[0], rows[-1]
        for a, b in zip(rows, rows[1:], strict=False):
            if others <= b[0]:
                lo, hi = a, b
                break
        w = 0.0 if hi[0] == lo[0] else min(1.0, max(0.0, (others - lo[0]) / (hi[0] - lo[0])))
        v = [x + w * (y - x) for x, y in zip(lo[1:], hi[1:], strict=True)]
        return v[0], v[1], v[2], v[3], v[4], v[5]

    def term_table(self, n: int) -> list[tuple[float, float, float, float, float, float]]:
        """`terms(b)` for b = 0..n (the simulator's lookup by batch)."""
        return [self.terms(b) for b in range(n + 1)]

    def handover(self, prompt_len: int) -> float:
        return self.handover_a_s + self.handover_b_s * prompt_len

    def p_prefill(self, base: PrefillCost) -> PrefillCost:
        """P's prefill step cost, given the plain worker's."""
        return base.scaled(self.prefill_factor)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitCost:
        return cls(**{k: v for k, v in d.items()
                      if k not in ("decode", "gap_jitter_s", "interference")},
                   decode=DecodeCost(**d["decode"]),
                   gap_jitter_s=parse_bins(d.get("gap_jitter_s", ())),
                   interference=tuple(tuple(float(v) for v in row)
                                      for row in d.get("interference", ())))
