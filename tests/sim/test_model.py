"""`costmodel.DecodeCost`'s per-batch levels: interpolation, scaling, JSON, the fit that measures
them and the simulator's steps that use them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.sim.costmodel import DecodeCost
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.profile import fit_decode
from splitserve.sim.records import token_times
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

LEVELS = ((1, 0.0), (2, 0.002), (4, -0.001), (8, 0.0005))
DEC = DecodeCost(0.010, 1e-6, 5e-4, LEVELS)


def test_levels_interpolate_between_measured_batches_and_hold_beyond() -> None:
    assert [DEC.level(b) for b in (1, 2, 3, 4, 6, 8, 16)] == pytest.approx(
        [0.0, 0.002, 0.0005, -0.001, -0.00025, 0.0005, 0.0005])
    assert DEC.time(3, 1000) == pytest.approx(0.010 + 1e-3 + 3 * 5e-4 + 0.0005)
    assert DecodeCost(0.010, 1e-6, 5e-4).level(5) == 0.0  # no levels: the linear form
    slow = DEC.scaled(1.5)
    assert slow.time(3, 1000) == pytest.approx(1.5 * DEC.time(3, 1000))
    assert slow.batch_levels[1] == (2, pytest.approx(0.003))


def test_levels_are_checked_and_survive_the_profile_json(tmp_path: object) -> None:
    for bad in (((0, 0.001),), ((2, 0.0), (2, 0.001)), ((4, 0.0), (2, 0.0)),
                ((1, float("nan")),), ((1, -0.02),)):
        with pytest.raises(ValueError):
            DecodeCost(0.010, 1e-6, 5e-4, bad)
    prof = replace(make_profile(), decode=DEC)
    back = Profile.from_dict(prof.to_dict())
    assert back.decode == DEC and back.decode.batch_levels == LEVELS


def test_fit_with_levels_matches_every_measured_batch() -> None:
    """Steps that are not linear in the batch (a bump at B = 2, a dip at B = 4, as D's steps
    through a router on shared cores): the linear fit misses them, its levels do not."""
    pts = [(b, c, DEC.time(b, c)) for b in (1, 2, 3, 4, 8) for c in (100.0 * b, 900.0 * b)
           if b != 3] + [(3, 300.0, DEC.time(3, 300.0))] * 3
    linear, _ = fit_decode(pts)
    assert linear.batch_levels == ()
    assert max(abs(linear.time(b, c) / t - 1) for b, c, t in pts) > 0.05
    got, quality = fit_decode(pts, levels=True)
    assert [b for b, _ in got.batch_levels] == [3]  # only B = 3 was measured >= 3 times
    assert got.time(3, 300.0) == pytest.approx(DEC.time(3, 300.0), rel=1e-9)
    pts = [(b, c, DEC.time(b, c)) for b in (1, 2, 4, 8) for c in (100.0, 500.0, 900.0)]
    got, quality = fit_decode(pts, levels=True)
    assert [b for b, _ in got.batch_levels] == [1, 2, 4, 8]
    # the context slope comes from the line, fitted with the batches' misfit in it (relative
    # weights): each level is exact at its batch's median context, within 0.1 % elsewhere
    assert all(got.time(b, c) == pytest.approx(t, rel=1e-3) for b, c, t in pts)
    assert got.time(2, 500.0) == pytest.approx(DEC.time(2, 500.0), rel=1e-9)
    assert quality["median_abs_rel_error_levels"] < 1e-3 < 0.05 < quality["median_abs_rel_error"]


def test_the_simulator_steps_at_each_batchs_level() -> None:
    """Two streams decode together, then one alone: each gap is the linear step plus the
    level of the batch it ran at."""
    wl = SimWorkload.of([0.0, 0.0], [100, 100], [40, 10])

    def gaps(dec: DecodeCost) -> list[float]:
        prof = replace(make_profile(), decode=dec)
        t = token_times(simulate(prof, SimConfig("colocated", n_workers=1), wl))[0]
        return [b - a for a, b in zip(t[1:], t[2:], strict=False)]

    extra = [a - b for a, b in zip(gaps(DEC), gaps(replace(DEC, batch_levels=())), strict=True)]
    assert extra[:7] == pytest.approx([DEC.level(2)] * 7)  # with the other stream
    assert extra[9:] == pytest.approx([DEC.level(1)] * (len(extra) - 9))  # alone
