"""The simulator's overlay seam: the null overlay is the plain cluster model, and a custom
overlay's hooks land where their contracts say."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.sim.calibration.costs import SplitCost
from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.overlay import Leg, Overlay
from splitserve.sim.run import simulate
from splitserve.sim.simulator import Simulation
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

WL = SimWorkload.of([0.0, 0.05, 0.4], [300, 200, 500], [12, 30, 8])


class _Shift(Overlay):
    """t1 10 ms late, the join 20 ms after t1 + hop at the earliest, D's steps twice as long
    while its first stream decodes, and a step of 5 ms extra right after each admission."""

    active = True

    def __init__(self) -> None:
        self.charged = [False]
        self.seen: list[str] = []

    def t1(self, at: float, leg: Leg) -> float:
        self.seen.append(f"t1 {leg}")
        return at + 0.01

    def join_ready(self, at: float, leg: Leg) -> float:
        return at + 0.02

    def decode_cost(self, base: DecodeCost) -> DecodeCost:
        return base.scaled(2.0)

    def arrived(self, d: int, t: float) -> None:
        self.seen.append("arrived")

    def admitted(self, d: int, others: int) -> None:
        self.charged[d] = True

    def decode_step(self, d: int, batch: int) -> tuple[float, float | None]:
        if self.charged[d]:
            self.charged[d] = False
            return 1.0, 0.005
        return 1.0, None


def test_split_costs_act_only_through_the_overlay() -> None:
    """A profile's split costs change nothing under the null overlay: it runs as the plain
    profile does."""
    prof, cfg = make_profile(), SimConfig("disagg", n_prefill=1, n_decode=2)
    split = replace(prof, split=SplitCost(0.003, 1.5, 0.05, 1e-5, DecodeCost(0.02, 1e-6, 1e-3),
                                          p_busy_stretch=0.3, t1_s=0.004, join_s=0.002))
    plain = simulate(prof, cfg, WL)
    assert simulate(split, cfg, WL).first_token.tolist() != plain.first_token.tolist()
    null = Simulation(split, cfg, WL, Overlay()).run()
    for field in ("first_token", "second_token", "finish", "seg_alpha", "seg_k"):
        assert getattr(null, field).tolist() == getattr(plain, field).tolist()


def test_custom_overlay_hooks_move_t1_the_join_and_d_steps() -> None:
    prof, cfg = make_profile(), SimConfig("disagg", overlap=False)
    lone = SimWorkload.of([0.0], [300], [3])
    base = simulate(prof, cfg, lone)
    ov = _Shift()
    o = Simulation(prof, cfg, lone, ov).run()
    # the per-request hooks get the request's values, not its index
    assert ov.seen == ["arrived", f"t1 {Leg(300, 3, prefill=0, decode=0)}"]
    assert o.first_token[0] == pytest.approx(base.first_token[0] + 0.01)
    kv = base.second_token[0] - base.first_token[0] - prof.decode.time(1, 301)
    join = max(kv - 0.01, 0.02)  # the KV left at P's step end, t1 is 10 ms later
    # the join step carries the 5 ms the admission charged, at twice the decode cost
    assert o.second_token[0] - o.first_token[0] == pytest.approx(
        join + 2 * prof.decode.time(1, 301) + 0.005)
    assert o.finish[0] - o.second_token[0] == pytest.approx(2 * prof.decode.time(1, 302))
