"""Core lists on command lines (`--cpus`, `--router-cpus`, ...): parsed, written, checked."""

from __future__ import annotations

import os
from collections.abc import Iterable


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0,1' or '0-3' or '0-1,4' -> core ids."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def core_list(cores: Iterable[int]) -> str:
    """Cores as a command line gives them: sorted, runs as ranges ("0-3,6")."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def check_cpus_usable(cpus: Iterable[int] | None, flag: str = "--cpus") -> None:
    """Raise ValueError naming the cores of `cpus` outside this process's affinity
    (`os.sched_getaffinity(0)`): a child pinned to them would fail as it starts. None: no
    cores asked for, nothing to check."""
    if cpus is None:
        return
    usable = os.sched_getaffinity(0)
    missing = set(cpus) - usable
    if missing:
        raise ValueError(f"{flag}: core(s) {core_list(missing)} not available to this process "
                         f"(it may use {core_list(usable)})")
