"""Which cores a test's vLLM worker is pinned to (`launch(..., cpus=...)`).

The suite is sized for a 2-core machine. Every connector pair the suite starts (the session's
`llama_pair`, the NIXL pair, the other architectures' and the TLS pair) puts P on `PREFILL` and
D on `DECODE`, and the colocated reference spans `BOTH`, so those pairs share the two cores
with each other and with every other pair. That is fine while one test at a time sends work, and
it is how the suite runs: test by test, never in parallel.

A worker a test adds beside them (a second P, a D with other settings) takes `spare_cores`:
a core of this process's affinity that no pair uses when the machine has one, else the core of
the pair's worker in the same role (on a 2-core machine an extra P shares core 0 with the pair's
P, which is idle while the extra one works).
"""

from __future__ import annotations

import os

PREFILL: tuple[int, ...] = (0,)
DECODE: tuple[int, ...] = (1,)
BOTH: tuple[int, ...] = PREFILL + DECODE
PAIR = {"prefill": PREFILL, "decode": DECODE}


def spare_cores(role: str | None, nth: int = 0) -> tuple[int, ...]:
    """The core for one more worker of `role` (None: a plain worker): the `nth` (from 0) core of
    this process's affinity that no pair uses, when the machine has one; else the pair's cores
    for that role. Number a test's extra workers 0, 1, ... so each gets a core of its own."""
    free = sorted(set(os.sched_getaffinity(0)) - set(BOTH))
    if nth < len(free):
        return (free[nth],)
    return PAIR[role] if role is not None else BOTH
