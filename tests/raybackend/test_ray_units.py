"""The Ray backend's pure logic: the autoscaling step, each pool's signal, the registry sync
plan, the directory's membership and cores, the YAML/flag surface, and the group guard (a
real process tree, no Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from splitserve.cli import build_parser
from splitserve.launch.cli import config_from_args
from splitserve.launch.config import load_yaml
from splitserve.launch.raybackend.autoscale import (
    DecodePolicy,
    PrefillPolicy,
    autoscaling_config,
    step,
)
from splitserve.launch.raybackend.deployment import local_cluster_resources, pin_revision
from splitserve.launch.raybackend.directory import WorkerDirectory
from splitserve.launch.raybackend.routerhost import plan_sync
from tests.support.workers import hub_cache

EXAMPLE = Path(__file__).parents[2] / "docs" / "ray-2p4d.yaml"


def ctx(current: int, target: int, **metrics: dict[str, float]) -> SimpleNamespace:
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=target,
                           aggregated_metrics=metrics, policy_state={})


def test_step_moves_one_replica_and_holds_while_a_change_is_in_progress() -> None:
    assert step(1, 1, needed=5.0, downscale_below=0.5) == 2  # never a jump to 5
    assert step(1, 2, needed=5.0, downscale_below=0.5) == 2  # starting: hold the target
    assert step(3, 2, needed=0.0, downscale_below=0.5) == 2  # stopping: hold as well
    assert step(2, 2, needed=1.5, downscale_below=0.5) == 2  # fits 2, not 1 at half load
    assert step(2, 2, needed=0.4, downscale_below=0.5) == 1
    assert step(1, 1, needed=0.0, downscale_below=0.5) == 1
    # a change still in progress after hold_s (a replica no node can place) is given up
    assert step(1, 2, needed=5.0, downscale_below=0.5, held_s=9.0, hold_s=10.0) == 2
    assert step(1, 2, needed=5.0, downscale_below=0.5, held_s=11.0, hold_s=10.0) == 1


def test_a_step_that_never_completes_is_given_up_after_hold_s() -> None:
    """The policy state keeps when the change began: held within `hold_s`, then the target
    goes back to the replicas running (Serve drops the unplaced one) and the pool scales on."""
    policy = DecodePolicy(running=8, kv_usage=0.5, downscale_below=0.5, hold_s=60.0)
    target, state = policy(ctx(1, 1, running={"a": 9.0}))
    assert target == 2 and state["changing_since"] is None
    starting = ctx(1, 2, running={"a": 9.0})
    target, state = policy(starting)
    assert target == 2 and state["changing_since"] is not None
    starting.policy_state = state
    assert policy(starting)[0] == 2  # just begun: held
    starting.policy_state = {**state, "changing_since": state["changing_since"] - 61.0}
    assert policy(starting)[0] == 1  # over a minute: given up
    idle = ctx(1, 1, running={"a": 0.0})
    idle.policy_state = {"changing_since": 0.0}  # a stale mark: no change is in progress
    assert policy(idle) == (1, {"needed": 0.0, "changing_since": None})


def test_prefill_scales_on_queued_prompt_tokens_only() -> None:
    policy = PrefillPolicy(queued_tokens=1000, downscale_below=0.5)
    busy = ctx(1, 1, queued_prompt_tokens={"a": 1500.0}, running={"a": 99.0})
    assert policy(busy)[0] == 2
    idle = ctx(2, 2, queued_prompt_tokens={"a": 100.0, "b": 200.0})
    assert policy(idle)[0] == 1
    assert policy(ctx(1, 1))[0] == 1  # no report yet: no change


def test_decode_scales_on_running_requests_or_kv_usage() -> None:
    policy = DecodePolicy(running=8, kv_usage=0.5, downscale_below=0.5)
    assert policy(ctx(1, 1, running={"a": 9.0}, kv_usage={"a": 0.1}))[0] == 2
    assert policy(ctx(1, 1, running={"a": 1.0}, kv_usage={"a": 0.9}))[0] == 2
    assert policy(ctx(2, 2, running={"a": 1.0, "b": 0.0}, kv_usage={"a": 0.1}))[0] == 1
    assert policy(ctx(2, 2, running={"a": 6.0}, kv_usage={"a": 0.1}))[0] == 2


def test_a_pool_of_fixed_size_has_no_autoscaling_config(tmp_path: Path) -> None:
    cfg = load_yaml(EXAMPLE)
    auto = autoscaling_config("prefill", cfg.ray.bounds("prefill", cfg.prefill), cfg.ray)
    assert auto is not None and (auto["min_replicas"], auto["max_replicas"]) == (2, 4)
    assert auto["policy"]["policy_function"].endswith(":PrefillPolicy")
    assert autoscaling_config("decode", (4, 4), cfg.ray) is None
    with pytest.raises(ValueError, match="below the pool's size"):
        load_yaml(EXAMPLE, {"prefill": 5})


def test_the_example_and_flags_choose_the_ray_backend(tmp_path: Path) -> None:
    cfg = load_yaml(EXAMPLE)
    assert (cfg.backend, cfg.prefill, cfg.decode) == ("ray", 2, 4)
    assert cfg.ray.resources("prefill") == {"prefill": 1.0}
    args = build_parser().parse_args(["serve", "--prefill", "1", "--decode", "1", "--ray"])
    cfg = config_from_args(args)
    assert (cfg.backend, cfg.ray_address) == ("ray", None)
    args = build_parser().parse_args(["serve", "--colocated", "1", "--ray", "10.0.0.1:6379"])
    assert config_from_args(args).ray_address == "10.0.0.1:6379"
    f = tmp_path / "d.yaml"
    f.write_text("colocated: 1\nray_address: 10.0.0.1:6379\n")
    with pytest.raises(ValueError, match="needs backend: ray"):
        load_yaml(f)
    f.write_text("colocated: 1\nbackend: ray\nray: {prefill_resources: {p: -1}}\n")
    with pytest.raises(ValueError, match="positive amount"):
        load_yaml(f)
    f.write_text("colocated: 1\nbackend: ray\nray: {replicas: 3}\n")
    with pytest.raises(ValueError, match="unknown ray keys"):
        load_yaml(f)


def test_a_local_cluster_gets_every_resource_the_pools_ask_for() -> None:
    cfg = load_yaml(EXAMPLE)
    assert local_cluster_resources(cfg) == {"prefill": 4.0, "decode": 4.0, "router": 1.0}


PIN = """
from splitserve.launch.config import from_mapping
from splitserve.launch.raybackend.deployment import pin_revision
print(pin_revision(from_mapping({"backend": "ray", "model": "org/name", "prefill": 1,
                                 "decode": 1})).revision)
"""


def test_a_hub_id_is_pinned_once_to_the_commit_its_revision_names(
        llama_ckpt: Path, tmp_path: Path) -> None:
    """The driver resolves `main` to its commit; replicas are handed that commit (offline hub
    cache, in a fresh process: huggingface_hub reads HF_HOME when imported)."""
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    hub_cache(tmp_path / "hf", "org/name", llama_ckpt, commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", PIN], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == commit
    cfg = load_yaml(EXAMPLE, {"model": str(llama_ckpt)})
    assert pin_revision(cfg) is cfg  # a directory is loaded as it is


def test_sync_adds_new_workers_and_removes_draining_or_vanished_ones() -> None:
    live = [{"kind": "prefill", "url": "http://p1", "draining": False},
            {"kind": "prefill", "url": "http://p2", "draining": False},
            {"kind": "decode", "url": "http://d1", "draining": True},
            {"kind": "decode", "url": "http://d2", "draining": False}]
    routed = [{"role": "prefill", "url": "http://p1", "node": "n1"},
              {"role": "prefill", "url": "http://p2", "node": None},  # started with the router
              {"role": "decode", "url": "http://d1", "node": "n2"},
              {"role": "decode", "url": "http://gone", "node": "n3"}]
    add, remove = plan_sync(live, routed)
    assert [w["url"] for w in add] == ["http://p2", "http://d2"]  # p2: only its node is set
    assert sorted(w["url"] for w in remove) == ["http://d1", "http://gone"]


def test_directory_claims_cores_per_machine_and_waits_for_the_router() -> None:
    d = WorkerDirectory(liveness=lambda: ({"a", "b", "c", "e", "f"}, set()))
    assert d.claim_cores("10.0.0.1", [0, 1, 2, 3], 2, "a") == (0, 1)
    assert d.claim_cores("10.0.0.1", [0, 1, 2, 3], 2, "b") == (2, 3)
    assert d.claim_cores("10.0.0.2", [0, 1, 2, 3], 2, "c") == (0, 1)  # another machine
    assert d.claim_cores("10.0.0.1", [0, 1, 2, 3], 1, "e") == (0,)  # all taken: shared
    assert d.placed() == ["a", "b", "c", "e"]
    d.register({"replica": "a", "kind": "decode", "url": "http://a", "node_id": "n",
                "node_ip": "10.0.0.1", "cores": (0, 1)})
    d.router_report("http://r0", {"http://a": {"inflight": 1.0, "inflight_prefill_tokens": 9.0}})
    d.router_report("http://r1", {"http://a": {"inflight": 2.0, "inflight_prefill_tokens": 0.0}})
    assert d.router_load("http://a") == {"inflight": 3.0, "inflight_prefill_tokens": 9.0}
    assert sorted(d.routers()) == ["http://r0", "http://r1"]
    d.drain("a")
    assert not d.drained("a")  # both routers still hold it
    d.released("a", "http://r0")
    assert not d.drained("a")  # r1 still does
    d.released("a", "http://r1")
    assert d.drained("a")
    d.router_stopped("http://r1")
    assert d.routers() == ["http://r0"]
    assert d.router_load("http://a") == {"inflight": 1.0, "inflight_prefill_tokens": 9.0}
    d.deregister("a")
    assert d.placed() == ["b", "c", "e"]
    assert d.claim_cores("10.0.0.1", [0, 1, 2, 3], 2, "f") == (0, 1)  # a's cores are free
    assert [h.get("decode", 0) for h in d.history()] == [1, 0, 0]
    d.set_secrets("tok", None)
    assert d.secrets() == ("tok", None)


def test_the_directory_frees_the_cores_of_replicas_gone_before_or_after_registering() -> None:
    d = WorkerDirectory()
    assert d.claim_cores("10.0.0.1", [0, 1], 1, "starting") == (0,)
    assert d.claim_cores("10.0.0.1", [0, 1], 1, "lost") == (1,)
    d.register({"replica": "lost", "kind": "decode", "url": "http://lost", "node_id": "n2",
                "node_ip": "10.0.0.1", "cores": (1,)})
    d.prune({"starting", "lost"}, {"n2"})  # "lost" still has an actor, on a dead node
    assert d.claim_cores("10.0.0.1", [0, 1], 1, "new") == (1,)
    d.prune({"new"}, set())  # "starting" died before it registered
    assert d.claim_cores("10.0.0.1", [0, 1], 1, "next") == (0,)


def test_a_replica_that_died_holding_cores_is_not_counted_placed() -> None:
    """A start waits until each pool's replicas are placed: one that claimed its cores and
    then died (its node lost, killed) must not count, or the start never times out."""
    alive = {"p1", "d1"}
    d = WorkerDirectory(liveness=lambda: (set(alive), set()))
    d.claim_cores("10.0.0.1", [0, 1], 1, "p1")
    d.claim_cores("10.0.0.1", [0, 1], 1, "d1")
    assert d.placed() == ["d1", "p1"]
    alive.discard("p1")
    assert d.placed() == ["d1"]


