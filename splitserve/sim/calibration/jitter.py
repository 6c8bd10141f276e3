"""The client's decode gaps around the engine's pace: the jitter the simulator adds to each
simulated step gap (`gap_jitter_s`, (seconds, weight per mille) bins). Measured on decode
windows where a fixed batch of B streams all decode together — a plain worker's
(`sim.profile`) or a deployment's through its router (`sim.calibrate`)."""

from __future__ import annotations

import numpy as np

from splitserve.bench.client import RequestRecord

NOISE_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 1.0)


def window_jitter(recs: list[RequestRecord]) -> list[float]:
    """Each chunk gap while all requests decode, less its request's local pace there: the
    least-squares line through that request's gaps in the window (seconds: the jitter is
    additive — gaps carrying an event's extra milliseconds spread no wider than plain ones).
    Against a line, not the window's mean: the context grows over the window and the simulated
    step already grows with it (`b·ctx`), so the drift is not jitter. Each request's first gap
    in the window is left out: through a router, the step after the last join carries that
    joiner's t2 relay (`SplitCost.t2_s`), a cost of its own, not jitter."""
    start = max(r.chunk_times[1] for r in recs)
    end = min(r.chunk_times[-1] for r in recs)
    out: list[float] = []
    for r in recs:
        t = np.array([x for x in r.chunk_times[1:] if start <= x <= end])
        if len(t) >= 5:
            gaps = np.diff(t)[1:]
            idx = np.arange(len(gaps), dtype=float)
            slope, icept = np.polyfit(idx, gaps, 1)
            out += (gaps - (icept + slope * idx)).tolist()
    return out


def noise_bins(values: list[float]) -> tuple[tuple[float, int], ...]:
    """A gap jitter distribution (seconds, or gap/mean-gap ratios) as (value at the bin's middle
    quantile, weight per mille) over NOISE_EDGES (fine in the upper tail, where ITL p99 lives)."""
    if len(values) < 50:
        return ()
    arr = np.asarray(values)
    return tuple((float(np.quantile(arr, (lo + hi) / 2)), round((hi - lo) * 1000))
                 for lo, hi in zip(NOISE_EDGES, NOISE_EDGES[1:], strict=False))
