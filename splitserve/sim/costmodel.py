"""The step and transfer cost model the simulator runs on.

One engine step on one worker (DistServe's form):

- prefill step over prompt chunks q_i (each after p_i tokens already prefilled):
  `a + b·Σq + c·Σ(q² + 2·p·q)` — for unchunked prompts this is `a + b·Σl + c·Σl²`, and chunking
  a prompt keeps the quadratic (attention) part equal to `c·l²` while paying `a` per chunk;
- decode step: `a + b·Σcontext + c·batch`, plus a measured level per batch where the linear
  form misses (`DecodeCost.batch_levels`);
- a mixed step (decodes plus a prefill chunk, as vLLM's chunked prefill runs them) pays the
  larger of the two fixed costs once plus both variable parts.

KV transfer: time = `bytes / bandwidth + latency` per transport (`TransferLink`, fitted to
measured samples by `fit_link`), pushed layer by layer during the prefill (`transfer_arrival`:
splitserve's connector) or pulled after it (`pull_arrival`: vLLM's NixlConnector).

Every cost is a frozen, validated value; this module imports nothing from the rest of
`splitserve.sim` (the profile, the calibration and the engine all build on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


def check_finite_nonneg(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {v}")


Bins = tuple[tuple[float, int], ...]  # (seconds | ratio, weight per mille)


def parse_bins(raw: Any) -> Bins:
    return tuple((float(v), int(w)) for v, w in raw)


def check_bins(owner: str, bins: Bins) -> None:
    if any(not math.isfinite(v) or w < 0 for v, w in bins):
        raise ValueError(f"{owner}.gap_jitter_s needs finite seconds and weights >= 0")


@dataclass(frozen=True)
class PrefillCost:
    """Seconds for one prefill step: a + b·Σq + c·Σ(q² + 2pq)."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        check_finite_nonneg("PrefillCost", a=self.a, b=self.b, c=self.c)

    def time(self, tokens: float, quad: float) -> float:
        """`tokens` = Σq, `quad` = Σ(q² + 2pq)."""
        return self.a + self.b * tokens + self.c * quad

    def whole(self, prompt_len: int) -> float:
        """One unchunked prompt alone in a step."""
        return self.a + self.b * prompt_len + self.c * prompt_len * prompt_len

    def scaled(self, k: float) -> PrefillCost:
        """The same cost on a machine that runs `k` times as slow."""
        return PrefillCost(self.a * k, self.b * k, self.c * k)


@dataclass(frozen=True)
class DecodeCost:
    """Seconds for one decode step: a + b·Σcontext + c·batch + level(batch).

    `batch_levels` ((batch, seconds) in increasing batch; empty: level 0) is what the measured
    steps at that batch take beyond the linear form; `level` interpolates linearly between the
    measured batches and holds the end values beyond them. Through a router whose host shares
    D's core with the router, the client and the API servers, D's step is not linear in its
    batch (B = 2 steps 1.04–1.27× the linear fit, B = 4 0.84–0.96×, on the demo deployment),
    so the calibration keeps each batch's level."""

    a: float
    b: float
    c: float = 0.0
    batch_levels: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        check_finite_nonneg("DecodeCost", a=self.a, b=self.b, c=self.c)
        levels = tuple((int(n), float(s)) for n, s in self.batch_levels)
        object.__setattr__(self, "batch_levels", levels)
        if any(n < 1 or not math.isfinite(s) for n, s in levels):
            raise ValueError("DecodeCost.batch_levels needs batches >= 1 and finite seconds")
        if any(m >= n for (m, _), (n, _) in zip(levels, levels[1:], strict=False)):
            raise ValueError("DecodeCost.batch_levels must be in increasing batch")
        if any(self.a + self.c * n + s <= 0 for n, s in levels):
            raise ValueError("DecodeCost.batch_levels make a step at some batch take no time")

    def level(self, batch: int) -> float:
        lv = self.batch_levels
        if not lv:
            return 0.0
        if batch <= lv[0][0]:
            return lv[0][1]
        for (m, x), (n, y) in zip(lv, lv[1:], strict=False):
            if batch <= n:
                return x + (y - x) * (batch - m) / (n - m)
        return lv[-1][1]

    def batch_term(self, batch: int) -> float:
        """The part of a step that depends on its batch alone: c·batch + level(batch)."""
        return self.c * batch + self.level(batch)

    def time(self, batch: int, context: float) -> float:
        return self.a + self.b * context + self.batch_term(batch)

    def scaled(self, k: float) -> DecodeCost:
        """The same cost on a machine that runs `k` times as slow."""
        return DecodeCost(self.a * k, self.b * k, self.c * k,
                          tuple((n, s * k) for n, s in self.batch_levels))


@dataclass(frozen=True)
class TransferLink:
    """One transport's KV transfer: time = bytes / bandwidth + latency."""

    bandwidth_Bps: float
    latency_s: float = 0.0
    source: str = "default"  # where the numbers came from (benchmark JSON path, "analytic", ...)

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth_Bps must be positive, got {self.bandwidth_Bps}")
        check_finite_nonneg("TransferLink", latency_s=self.latency_s)

    def time(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps + self.latency_s



def fit_link(samples: list[tuple[float, float]], source: str) -> TransferLink:
    """time = bytes / bandwidth + latency, fitted to (bytes, seconds) samples."""
    if len(samples) == 1:
        nbytes, secs = samples[0]
        return TransferLink(float(nbytes / secs), 0.0, source)
    x = np.array([[b, 1.0] for b, _ in samples])
    (inv_bw, lat), *_ = np.linalg.lstsq(x, np.array([s for _, s in samples]), rcond=None)
    if inv_bw <= 0:
        raise ValueError(f"{source}: transfer time does not grow with bytes; cannot fit")
    return TransferLink(float(1.0 / inv_bw), max(0.0, float(lat)), source)


def fit_link_or_span(best: dict[int, float], source: str) -> TransferLink:
    """`fit_link` of a probe's fastest time per size; where the fit degenerates (time not
    growing with bytes, on a noisy machine), bandwidth from the largest size and latency from
    the smallest, labelled "unfitted"."""
    try:
        return fit_link(sorted(best.items()), source)
    except ValueError:
        big, small = max(best), min(best)
        return TransferLink(big / best[big], best[small], source + ", unfitted")


def transfer_arrival(link: TransferLink, nbytes: float, layers: int, prefill_start: float,
                     prefill_end: float, overlap: bool, link_free: float = 0.0
                     ) -> tuple[float, float]:
    """When a prompt's KV is all at D, and when the link is free again.

    Without overlap the whole KV goes after the prefill: it starts when the prefill ends and the
    link is free. With layer-wise overlap, layer i's KV can leave once layer i is computed (layers
    take equal time); the last layer's share still has to cross after the prefill ends. The link
    is a FIFO server: a transfer starts no earlier than `link_free`.
    """
    _, arrive, free = transfer_window(link, nbytes, layers, prefill_start, prefill_end,
                                      overlap, link_free)
    return arrive, free


def transfer_window(link: TransferLink, nbytes: float, layers: int, prefill_start: float,
                    prefill_end: float, overlap: bool, link_free: float = 0.0
                    ) -> tuple[float, float, float]:
    """`transfer_arrival` with the push's start first: (when the first bytes start moving on
    the link, when the KV is all at D, when the link is free again)."""
    send = nbytes / link.bandwidth_Bps
    if not overlap:
        start = max(prefill_end, link_free)
        end = start + send
    else:
        first_ready = prefill_start + (prefill_end - prefill_start) / layers
        start = max(first_ready, link_free)
        end = max(start + send, prefill_end + send / layers)
    return start, end + link.latency_s, end


def pull_arrival(link: TransferLink, nbytes: float, ready: float, link_free: float = 0.0
                 ) -> tuple[float, float]:
    """When a prompt's KV is all at D, and when the link is free again, for a pull (vLLM's
    NixlConnector): D reads P's whole blocks from `ready` (its leg reached it, after P's
    prefill ended), so the whole transfer is exposed. FIFO link, as `transfer_arrival`."""
    start = max(ready, link_free)
    end = start + nbytes / link.bandwidth_Bps
    return end + link.latency_s, end
