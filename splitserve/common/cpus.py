"""Core lists on command lines (`--cpus`, `--router-cpus`, ...)."""

from __future__ import annotations


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0,1' or '0-3' or '0-1,4' -> core ids."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)
