"""Core lists on command lines (`--cpus`, `--router-cpus`, ...): parsed, written, checked."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Iterable


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0,1' or '0-3' or '0-1,4' -> core ids, in the order given. ValueError for anything else:
    a part that is not a core or a range `lo-hi` with lo <= hi, or a core given twice (two
    workers would be pinned to it)."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"not a core list like 0-3,6: {text!r}")
        if dash and int(hi) < int(lo):
            raise ValueError(f"the range {part.strip()} runs backwards (in {text!r})")
        cpus += range(int(lo), int(hi or lo) + 1)
    check_distinct(cpus, text)
    return tuple(cpus)


def cpus_flag(text: str) -> tuple[int, ...]:
    """`parse_cpus` as an argparse `type`: its message, not argparse's "invalid value"."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_distinct(cpus: Iterable[int], what: str) -> None:
    """ValueError naming the cores `cpus` lists more than once."""
    twice = [core for core, n in Counter(cpus).items() if n > 1]
    if twice:
        raise ValueError(f"core(s) {core_list(twice)} given twice (in {what!r})")


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
