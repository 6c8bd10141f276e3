"""The simulator routes with the router's own policies, by the same names."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.common.vocab import Pool
from splitserve.router.config import DECODE_POLICIES, PREFILL_POLICIES
from splitserve.router.policy import Picker
from splitserve.routing import POLICIES, WorkerView
from splitserve.sim.deployment import POLICIES as SIM_POLICIES
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.routing import SimWorkerView, pick, pick_all
from splitserve.sim.run import simulate
from splitserve.sim.workerstate import COLOCATED, DECODE, PREFILL, Worker
from splitserve.sim.workload import SimWorkload

ROLE = {Pool.PREFILL: PREFILL, Pool.DECODE: DECODE, Pool.COLOCATED: COLOCATED}


def pool_of(profile: Profile, pool: Pool, m: int) -> list[Worker]:
    return [Worker(ROLE[pool], profile.prefill, profile.decode, 8) for _ in range(m)]


def test_every_router_policy_has_its_simulated_twin(profile: Profile) -> None:
    """Each name the router accepts, per pool, the simulator accepts and runs with the very
    same policy class."""
    router_names = {Pool.PREFILL: PREFILL_POLICIES, Pool.DECODE: DECODE_POLICIES,
                    Pool.COLOCATED: (Picker().policies[Pool.COLOCATED].name,)}
    for pool, names in router_names.items():
        for name in names:
            assert name in SIM_POLICIES
            choices = pick_all(np.random.default_rng(0), pool_of(profile, pool, 3), name, 4,
                               prompt_lens=[10] * 4)
            assert type(choices.policy) is POLICIES[pool][name]
    for name in PREFILL_POLICIES:
        assert SimConfig(p_policy=name, d_policy=name).p_policy == name  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SimConfig(p_policy="no_such_policy")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", SIM_POLICIES)
@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_each_policy_runs_every_request(profile: Profile, policy: str, mode: str) -> None:
    rng = np.random.default_rng(3)
    n = 60
    wl = SimWorkload.of(np.cumsum(rng.exponential(0.05, n)), rng.integers(8, 400, n),
                        rng.integers(1, 20, n))
    cfg = SimConfig(mode=mode, n_prefill=2, n_decode=2, n_workers=3,  # type: ignore[arg-type]
                    p_policy=policy, d_policy=policy)  # type: ignore[arg-type]
    out = simulate(profile, cfg, wl)
    assert np.isfinite(out.finish).all() and not out.failed.any()


def test_load_sends_a_prompt_where_the_fewest_prompt_tokens_wait(profile: Profile) -> None:
    ps = pool_of(profile, Pool.PREFILL, 3)
    ps[0].queue.extend([0, 1])
    ps[0].load = 900
    ps[1].queue.append(2)
    ps[1].load = 100
    ps[2].queue.extend([3, 4])
    ps[2].load = 50  # fewer tokens, but one of its two prompts waits behind the other
    choices = pick_all(np.random.default_rng(0), ps, "load", 6, prompt_lens=[10] * 5 + [300])
    assert pick(ps, "load", choices, 0, []) == 2  # 50 + 1 x 10 + 10 < 100 + 0 + 10
    assert pick(ps, "load", choices, 5, []) == 1  # 100 + 300 < 50 + 1 x 300 + 300


def test_a_simulated_worker_is_a_worker_view(profile: Profile) -> None:
    (d,) = pool_of(profile, Pool.DECODE, 1)
    d.load, d.kv_used, d.batch = 2, 250, 1
    d.waiting.append(7)
    view = SimWorkerView(d, 0, kv_capacity=1000)
    assert isinstance(view, WorkerView)
    assert (view.inflight, view.inflight_prefill_tokens, view.waiting, view.running,
            view.kv_usage, view.staging_capacity_bytes) == (2, 0, 1.0, 1.0, 0.25, 0.0)


def test_cache_runs_as_load_in_the_simulator(profile: Profile) -> None:
    """The simulator has no prefix identity: `cache` sees nothing cached and makes `load`'s
    every choice, so a run is the same run."""
    rng = np.random.default_rng(4)
    n = 80
    wl = SimWorkload.of(np.cumsum(rng.exponential(0.03, n)), rng.integers(8, 800, n),
                        rng.integers(1, 20, n))
    for mode in ("disagg", "colocated"):
        runs = [simulate(profile, SimConfig(
            mode=mode, n_prefill=2, n_decode=2, n_workers=3,  # type: ignore[arg-type]
            p_policy=policy, d_policy=policy), wl)  # type: ignore[arg-type]
            for policy in ("cache", "load")]
        for a, b in zip(runs[0].finish, runs[1].finish, strict=True):
            assert a == b
        assert np.array_equal(runs[0].decode_worker, runs[1].decode_worker)
