"""The simulated router's choice of a worker per request (round_robin, random, power_of_two,
least_loaded over `Worker.load`); the simulator calls these on each arrival."""

from __future__ import annotations

import numpy as np

from splitserve.sim.workerstate import Worker


def pick_all(rng: np.random.Generator, pool: list[Worker], policy: str, n: int
             ) -> list[int] | None:
    """Choices that do not depend on load, drawn for all requests at once (None: per arrival)."""
    m = len(pool)
    if policy == "round_robin":
        return [i % m for i in range(n)]
    if policy == "random":
        return rng.integers(0, m, size=n).tolist()
    return None


def pick(pool: list[Worker], policy: str, pre: list[int] | None, i: int,
         two: list[list[int]]) -> int:
    """Request i's worker: the pre-drawn choice, the less loaded of two drawn candidates, or the
    least loaded of all."""
    if pre is not None:
        return pre[i]
    if policy == "power_of_two":
        a, b = two[0][i], two[1][i]
        return a if pool[a].load <= pool[b].load else b
    return min(range(len(pool)), key=lambda j: pool[j].load)
