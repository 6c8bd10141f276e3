"""A worker's limits and load hold through the corner cases of a disaggregated run: a D that
prefills a prompt itself over several steps keeps within `max_num_seqs`, and a request that
can never fit on its P gives back the load it put on its D."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from splitserve.sim.costmodel import DecodeCost, PrefillCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.simulator import Simulation
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

B = 16  # tokens a block


def test_a_prompt_prefilled_on_d_holds_a_place_in_its_batch() -> None:
    """r1 shares r0's 4 blocks and adds 100 tokens: it runs whole on D, chunked over several
    steps (budget 16); the legs of r2 and r3 reach D meanwhile. D's batch (max 2) never
    exceeds its limit when r1's prefill ends."""
    prof = replace(make_profile(PrefillCost(0.01, 1e-4, 0.0), DecodeCost(0.005, 0.0, 0.0),
                                budget=16, capacity=100_000), max_num_seqs=2)
    blocks = ((1, 2, 3, 4), (1, 2, 3, 4, *range(100, 107)), (200, 201), (300, 301))
    wl = SimWorkload(np.array([0.0, 0.3, 0.31, 0.32]), np.array([64, 164, 32, 32]),
                     np.array([400, 5, 400, 400]), blocks, B)
    sim = Simulation(prof, SimConfig("disagg", 1, 1, p_policy="cache", d_policy="cache"), wl)
    o = sim.run()
    assert sim.local == [False, True, False, False]
    assert not o.failed.any() and np.isfinite(o.finish).all()
    assert int(o.seg_batch.max()) == 2


@pytest.mark.parametrize("policy", ["least_loaded", "load", "power_of_two"])
def test_a_request_failed_on_p_gives_back_its_ds_load(policy: str) -> None:
    """The first 3 prompts can never fit P's KV; every request ends before the next comes, so
    every worker ends with no load, and the balancing policies then pick D-worker 0 (the
    first of equals) for every request."""
    prof = make_profile(PrefillCost(0.01, 1e-5, 0.0), DecodeCost(0.005, 0.0, 0.0),
                        capacity=2000)
    n = 40
    wl = SimWorkload.of(np.arange(n) * 1.0, [3000 if i < 3 else 100 for i in range(n)],
                        [10] * n)
    sim = Simulation(prof, SimConfig("disagg", n_prefill=1, n_decode=2, d_policy=policy), wl)
    o = sim.run()
    assert int(o.failed.sum()) == 3
    assert [d.load for d in sim.D] == [0, 0] and [p.load for p in sim.P] == [0]
    if policy != "power_of_two":
        assert set(o.decode_worker[~o.failed].tolist()) == {1}
