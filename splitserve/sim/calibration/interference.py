"""How other processes' work slows D's decode steps in a disaggregated deployment whose workers
share a host's cores with the router and the client (`SplitCost.p_busy_stretch`, `arrive_s`,
`t1_s`, `join_s`, `finish_s`, `t2_s`), measured by a probe that is no validation workload:

For each size in `bg_batches`, that many long background streams decode on D while `injections`
requests (prompts cycling through `inject_lens`, `inject_tokens` tokens each) arrive one by one,
spaced so that each one's events — arrival, t1, joining D, end — fall apart from the others'.
Each size gives one row of `SplitCost.interference` (the terms with that many other streams on
D; the simulator interpolates between rows): the stretch and the events' seconds shrink as D's
batch grows (gaps while P prefilled were 1.15–1.2× the idle ones at B = 1–2 and 1.07–1.12× at
B = 3–5 on the demo deployment), so one size cannot stand for all. Each background gap is compared
with D's calibrated step at that moment's batch and context (`DecodeCost`); gaps with no request
event give the pace while P idles and while P prefills (P's busy windows are the FIFO intervals
[max(send, previous t1), t1] over all requests, P being one worker). An event's extra seconds
are read off the gaps where its work lands (`fit_interference`), over events whose gaps hold no
other event: an arrival's and an end's, the gap holding it plus the gap after (the work lands on
the step in progress or, if it comes at the step's end, on the next: the simulator puts it on
the next); t1's, the gap holding it; a join's, its join step (the gap that ends nearest the
joiner's t2); the joiner's t2 relay, the gap after the join step. t1 and the join come one step
apart, so the joiner's handover holds both: t1 is read off its own gap only (its gap plus the
next would count the join step twice).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.bench.client import RequestRecord
from splitserve.bench.workload import Request
from splitserve.sim.costmodel import DecodeCost

EVENTS = ("arrive", "t1", "join", "finish")
# the seconds `fit_interference` reads: the events' and the joiner's t2 relay (SplitCost order)
TERMS = (*EVENTS, "t2")


@dataclass(frozen=True)
class InterferencePlan:
    bg_batches: tuple[int, ...] = (1, 4)  # increasing; one probe run each
    bg_prompt: int = 128
    injections: int = 18  # per run: an event's median over fewer was ±1 ms run to run
    inject_lens: tuple[int, ...] = (128, 320, 512)
    inject_tokens: int = 12
    first_s: float = 0.8  # the background streams have all joined D by then
    spacing_s: float = 0.45  # > the longest injected request's prefill + handover + decode

    def __post_init__(self) -> None:
        if (not self.bg_batches or min(self.bg_batches) < 1 or self.injections < 3
                or not self.inject_lens):
            raise ValueError("need >= 1 background stream and >= 3 injections")
        if any(a >= b for a, b in zip(self.bg_batches, self.bg_batches[1:], strict=False)):
            raise ValueError("bg_batches must increase")
        if self.inject_tokens < 3 or self.spacing_s <= 0 or self.first_s <= 0:
            raise ValueError("inject_tokens >= 3 and positive times")

    @property
    def duration_s(self) -> float:
        return self.first_s + self.injections * self.spacing_s


def probe_stream(plan: InterferencePlan, bg: int, bg_tokens: int, prompt: Any) -> list[Request]:
    """`bg` background streams (arriving at 0) then the injected requests; `prompt(n)` makes an
    n-token prompt."""
    reqs = [Request(i, 0.0, prompt(plan.bg_prompt), bg_tokens) for i in range(bg)]
    for j in range(plan.injections):
        n = plan.inject_lens[j % len(plan.inject_lens)]
        reqs.append(Request(len(reqs), plan.first_s + j * plan.spacing_s, prompt(n),
                            plan.inject_tokens))
    return reqs


def _p_busy(recs: list[RequestRecord]) -> list[tuple[float, float]]:
    out, prev = [], -np.inf
    for r in sorted(recs, key=lambda r: r.chunk_times[0]):
        start = max(r.send_s, prev)
        out.append((start, r.chunk_times[0]))
        prev = r.chunk_times[0]
    return out


Row = tuple[int, float, float, float, tuple[str, ...]]


def _events(recs: list[RequestRecord]) -> list[tuple[str, float]]:
    return [(name, t) for r in recs
            for name, t in zip(EVENTS, (r.send_s, r.chunk_times[0], r.chunk_times[1],
                                        r.chunk_times[-1]), strict=True)]


def _rows(recs: list[RequestRecord], streams: range, events: list[tuple[str, float]],
          decode: DecodeCost, start: float = -np.inf, end: float = np.inf) -> list[Row]:
    """The rows of `recs[i]`'s gaps from t2 on, i in `streams`, inside [start, end]. An event
    belongs to the gap that holds it, but a join (another request's t2) to the gap that ends
    nearest it, within half that gap: its join step, whose token reaches the client in the
    same relay as t2, a little before or after it (else the gap that holds it)."""
    busy = _p_busy(recs)
    joins = [x for n, x in events if n == "join"]
    rows = []
    for i in streams:
        t = recs[i].chunk_times
        at = [_join_gap(t, x) for x in joins]
        for k, (a, b) in enumerate(zip(t[1:], t[2:], strict=False)):
            if a < start or b > end or b <= a:
                continue
            live = [q for q in recs if q.chunk_times[1] <= b <= q.chunk_times[-1]]
            ctx = sum(q.input_len + bisect.bisect_right(q.chunk_times, a) for q in live)
            pb = sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy) / (b - a)
            here = tuple(n for n, x in events if n != "join" and a < x <= b)
            here += ("join",) * at.count(k)
            rows.append((i, b - a, decode.time(len(live), ctx), pb, here))
    return rows


def _join_gap(t: list[float], x: float) -> int | None:
    """The index k of the gap (t[k+1], t[k+2]] a join at x belongs to (`_rows`); None: none."""
    ends = t[2:]
    if not ends:
        return None
    k = min(range(len(ends)), key=lambda j: abs(ends[j] - x))
    if abs(ends[k] - x) <= (ends[k] - t[k + 1]) / 2:
        return k
    k = bisect.bisect_left(ends, x)  # the first gap ending at or after x
    return k if k < len(ends) and t[k + 1] < x else None


def gap_rows(recs: list[RequestRecord], bg: int, decode: DecodeCost) -> list[Row]:
    """(stream, gap s, D's calibrated step s, P-busy fraction, events in the gap) for every
    background gap while all background streams decode, in time order per stream (records in
    request order, background first); the events are the injected requests'."""
    back = recs[:bg]
    return _rows(recs, range(bg), _events(recs[bg:]), decode,
                 max(r.chunk_times[1] for r in back), min(r.chunk_times[-1] for r in back))


def workload_rows(recs: list[RequestRecord], decode: DecodeCost) -> list[Row]:
    """The same rows for every gap from t2 on of every request of a measured 1P+1D run (P is
    one worker), with every request's events: `Pace.of` them is the P-busy stretch that run
    met (a diagnostic for the stretch canary). Requests with fewer than 2 chunks are left
    out."""
    recs = [r for r in recs if len(r.chunk_times) >= 2]
    return _rows(recs, range(len(recs)), _events(recs), decode)


MIN_IDLE_GAPS, MIN_BUSY_GAPS = 10, 5


@dataclass(frozen=True)
class Pace:
    """D's clean gaps (no request event in them) over its calibrated step: the median while P
    idles for the whole gap and while P prefills for the whole gap, and how many of each."""

    idle: float
    busy: float | None  # None: fewer than MIN_BUSY_GAPS busy gaps
    idle_gaps: int
    busy_gaps: int

    @classmethod
    def of(cls, rows: list[Row]) -> Pace:
        """Raises RuntimeError with fewer than MIN_IDLE_GAPS clean gaps while P idles."""
        idle = [g / p for _, g, p, pb, ev in rows if not ev and pb == 0.0]
        full = [g / p for _, g, p, pb, ev in rows if not ev and pb >= 1.0]
        if len(idle) < MIN_IDLE_GAPS:
            raise RuntimeError(f"P-busy pace: only {len(idle)} clean gaps while P idles")
        busy = statistics.median(full) if len(full) >= MIN_BUSY_GAPS else None
        return cls(statistics.median(idle), busy, len(idle), len(full))

    @property
    def ratio(self) -> float | None:
        """Busy over idle pace: how many times as long D's steps take while P prefills (1.0:
        no slowdown; below 1 only by noise); None without enough busy gaps."""
        return None if self.busy is None else self.busy / self.idle

    @property
    def stretch(self) -> float:
        """`p_busy_stretch`: the ratio less 1, never below 0 (0 without busy gaps)."""
        return 0.0 if self.ratio is None else max(0.0, self.ratio - 1.0)


def background_tokens(plan: InterferencePlan, bg: int, decode: DecodeCost,
                      max_model_len: int) -> int:
    """Tokens per background stream so that `bg` streams outlast the probe's injections with a
    1.5× margin on `decode`'s pace (with one injected stream and the longest prompt joined)."""
    step = decode.time(bg + 1, (bg + 1) * (plan.bg_prompt + max(plan.inject_lens)))
    return min(int(1.5 * (plan.duration_s + 0.5) / step) + 1, max_model_len - plan.bg_prompt - 1)


def fit_interference(rows: list[Row]) -> tuple[float, dict[str, float], dict[str, Any]]:
    """(p_busy_stretch, seconds per term (`TERMS`), quality). The pace while P idles (gap over
    the calibrated step, no event) is the reference, so the terms do not absorb the decode
    fit's level. Each term is the median excess, over the rows where it stands alone, of:
    the event's gap and the next (an arrival, an end: work that may spill into the next step);
    the gap holding t1 (the step in progress; what spills lands on the join step); the join
    step; the gap after the join step (`t2`: the relay of the joiner's first token from D)."""
    pace = Pace.of(rows)
    s0, kappa = pace.idle, pace.stretch
    excess = [g - p * s0 * (1.0 + kappa * pb) for _, g, p, pb, _ in rows]
    same = [rows[j][0] == rows[j + 1][0] for j in range(len(rows) - 1)] + [False]
    samples: dict[str, list[float]] = {n: [] for n in TERMS}
    for j, row in enumerate(rows):
        clean_next = same[j] and not rows[j + 1][4]
        if row[4] in (("arrive",), ("finish",)) and clean_next:
            samples[row[4][0]].append(excess[j] + excess[j + 1])
        elif row[4] in (("t1",), ("join",)):
            samples[row[4][0]].append(excess[j])
            if row[4] == ("join",) and clean_next:
                samples["t2"].append(excess[j + 1])
    cost = {n: max(0.0, statistics.median(x)) if len(x) >= 3 else 0.0
            for n, x in samples.items()}
    quality = {"idle_pace": s0, "clean_idle_gaps": pace.idle_gaps,
               "clean_busy_gaps": pace.busy_gaps,
               "event_gaps": {n: len(x) for n, x in samples.items()}}
    return kappa, cost, quality


def interference_rows(fits: list[tuple[int, float, dict[str, float]]]
                      ) -> tuple[tuple[float, ...], ...]:
    """`SplitCost.interference` rows from (background streams, p_busy_stretch, event seconds)
    per probe run. Every term is measured with the background streams as D's other streams
    (P prefills while only they decode; the arrival and t1 come before the request joins, the
    join and the end are charged net of the request itself), so the row's batch is `bg`."""
    return tuple((float(bg), kappa, *(cost[n] for n in TERMS))
                 for bg, kappa, cost in sorted(fits, key=lambda f: f[0]))
