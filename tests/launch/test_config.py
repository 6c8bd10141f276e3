"""Deployment descriptions and core plans (pure logic)."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest

from splitserve.common.privatedir import remove_worker_dir
from splitserve.common.vocab import Role
from splitserve.launch.config import DeploymentConfig, from_mapping, load_yaml
from splitserve.launch.local import LocalDeployment, plan_cores


def test_enough_cores_gives_every_worker_its_own() -> None:
    plan = plan_cores(list(range(9)), 2)
    assert plan.router == (0,) and plan.workers == ((1, 2, 3, 4), (5, 6, 7, 8))
    assert "4 core(s) per worker" in plan.note


def test_exactly_one_core_each_shares_the_router() -> None:
    plan = plan_cores([0, 1], 2)
    assert plan.workers == ((0,), (1,)) and plan.router == (0, 1)
    assert "shares" in plan.note


def test_too_few_cores_spreads_evenly_and_says_so() -> None:
    plan = plan_cores([0, 1], 3)
    assert plan.workers == ((0,), (1,), (0,)) and "share cores" in plan.note


def test_the_router_can_be_given_its_own_cores(tmp_path: Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 1\ndecode: 1\ncpus: [0, 1]\nrouter_cpus: [1]\n")
    cfg = load_yaml(f)
    assert cfg.router_cpus == (1,)
    dep = LocalDeployment(cfg)
    assert [w.cpus for _, w in dep.plan_workers()] == [(0,), (1,)]
    assert dep.router_cpus == (1,) and "puts the router on cpus 1" in dep.core_note
    plain = LocalDeployment(DeploymentConfig(prefill=1, decode=1, cpus=(0, 1)))
    plain.plan_workers()
    assert plain.router_cpus == (0, 1)


def test_yaml_with_flags_overriding(tmp_path: Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 2\ndecode: 1\ntransport: shm\nport: 9001\n"
                 "router: {decode_policy: round_robin}\n")
    cfg = load_yaml(f, {"port": 9002, "decode": None})
    assert (cfg.prefill, cfg.decode, cfg.transport, cfg.port) == (2, 1, "shm", 9002)
    assert cfg.decode_policy == "round_robin" and cfg.n_workers == 3


@pytest.mark.parametrize("data, message", [
    ({"prefill": 1}, "go together"),
    ({}, "nothing to start"),
    ({"colocated": 1, "transport": "udp"}, "transport"),
    ({"colocated": 1, "model": "/no/such/dir"}, "does not exist"),
    ({"colocated": 1, "bogus": 1}, "unknown deployment keys"),
    ({"colocated": 1, "router": {"bogus": 1}}, "unknown router keys"),
    ({"colocated": 1, "port": 0}, "port"),
    ({"colocated": -1}, "negative"),
    ({"colocated": 1, "router_cpus": []}, "router_cpus"),
    ({"colocated": 1, "routers": 0}, "routers must be at least 1"),
    ({"colocated": 1, "routers": "2"}, "routers: expected an integer, got '2'"),
    ({"prefill": "1", "decode": 1}, "prefill: expected an integer"),
    ({"colocated": 1, "port": "8000"}, "port: expected an integer"),
    ({"colocated": 1, "kv_events": "no"}, "kv_events: expected true or false"),
    ({"colocated": 1, "log_dir": 5}, "log_dir: expected a string"),
    ({"colocated": 1, "max_model_len": "4096"}, "max_model_len: expected an integer"),
    ({"colocated": 1, "max_num_batched_tokens": 2048.5}, "max_num_batched_tokens: expected an"),
    ({"colocated": 1, "revision": 1.0}, "revision: expected a string"),
    ({"colocated": 1, "kv_lease_s": "30"}, "kv_lease_s: expected a number"),
    ({"colocated": 1, "cpus": "0-x"}, "cpus: not a core list"),
    ({"colocated": 1, "cpus": "0-1,1"}, r"cpus: core\(s\) 1 given twice"),
    ({"colocated": 1, "cpus": [0, 0]}, r"core\(s\) 0 given twice"),
    ({"colocated": 1, "router_cpus": "3-2"}, "router_cpus: the range 3-2 runs backwards"),
    ({"colocated": 1, "worker_args": "--x"}, "worker_args: expected a list"),
    ({"colocated": 1, "worker_args": ["--max-num-seqs", 64]}, "each a string"),
    ({"colocated": 1, "kv_cache_gib": 0}, "kv_cache_gib must be at least 1"),
    ({"colocated": 1, "staging_mib": 0}, "staging_mib must be at least 1"),
    ({"colocated": 1, "max_inflight": 0}, "max_inflight must be at least 1"),
    ({"colocated": 1, "stop_timeout_s": -1}, "stop_timeout_s must be positive"),
    ({"colocated": 1, "startup_timeout_s": 0}, "startup_timeout_s must be positive"),
    ({"colocated": 1, "routers": 3, "port": 65534}, "run past 65535"),
])
def test_invalid_deployments_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_mapping(data)


def test_yaml_as_people_write_it(tmp_path: Path) -> None:
    """Core lists as the flag takes them, and the module's own example (its TLS files made)."""
    f = tmp_path / "d.yaml"
    f.write_text("colocated: 2\ncpus: 0-1\nrouter_cpus: 1\n")
    cfg = load_yaml(f)
    assert (cfg.cpus, cfg.router_cpus) == ((0, 1), (1,))
    f.write_text("prefill: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_yaml(f)
    import splitserve.launch.config as module

    doc = module.__doc__ or ""
    example = textwrap.dedent(doc[doc.index("Example:") + len("Example:"):])
    (tmp_path / "certs").mkdir()
    for name in ("kv.pem", "kv.key", "ca.pem"):
        (tmp_path / "certs" / name).write_text("")
    f.write_text(example)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        cfg = load_yaml(f)
    finally:
        os.chdir(cwd)
    assert (cfg.prefill, cfg.decode, cfg.routers, cfg.backend) == (1, 1, 2, "ray")


def test_defaults_are_the_embedded_model() -> None:
    assert DeploymentConfig(colocated=1).model == "embedded"


def test_yaml_connector_reaches_every_connector_worker(tmp_path: Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 1\ndecode: 1\ncolocated: 1\ncpus: [0, 1]\nconnector: nixl\n"
                 "kv_lease_s: 20\n")
    cfg = load_yaml(f)
    assert cfg.connector == "nixl"
    planned = [w for _, w in LocalDeployment(cfg).plan_workers()]
    assert [(w.role, w.connector, w.lease_s) for w in planned] == [
        ("prefill", "nixl", 20.0), ("decode", "nixl", 20.0), (None, "nixl", 20.0)]
    assert len({w.kv_port for w in planned if w.role}) == 2  # a side channel per worker
    assert DeploymentConfig(colocated=1).connector == "splitserve"
    with pytest.raises(ValueError, match="connector"):
        DeploymentConfig(colocated=1, connector="lmcache")


def test_cache_routing_is_the_default_and_reaches_the_router(tmp_path: Path) -> None:
    """`cache` for P and D and prefill on D up to 128 tokens, unless the YAML's `router:` or
    `splitserve serve`'s flags say otherwise; the router's command line carries them (local
    and Ray: both start the router with `router_argv`)."""
    from splitserve.launch.cli import config_from_args, register
    from splitserve.launch.local import router_argv
    from splitserve.router.cli import add_router_arguments
    from splitserve.router.cli import config_from_args as router_config

    cfg = DeploymentConfig(prefill=1, decode=1)
    assert (cfg.prefill_policy, cfg.decode_policy, cfg.local_prefill_max_tokens) == (
        "cache", "cache", 128)
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 1\ndecode: 1\n"
                 "router: {prefill_policy: load, local_prefill_max_tokens: 0}\n")
    from_yaml = load_yaml(f)
    assert (from_yaml.prefill_policy, from_yaml.local_prefill_max_tokens) == ("load", 0)
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        DeploymentConfig(prefill=1, decode=1, local_prefill_max_tokens=-1)

    import argparse
    top = argparse.ArgumentParser()
    register(top.add_subparsers())
    args = top.parse_args(["serve", "--prefill", "1", "--decode", "1", "--decode-policy",
                           "load", "--local-prefill-max-tokens", "64"])
    served = config_from_args(args)
    assert (served.prefill_policy, served.decode_policy, served.local_prefill_max_tokens) == (
        "cache", "load", 64)

    argv = router_argv(served, str(tmp_path), "127.0.0.1",
                       {"prefill": ["http://p:1"], "decode": ["http://d:1"]})
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    rcfg = router_config(p.parse_args(argv[argv.index("router") + 1:]))
    assert (rcfg.prefill_policy, rcfg.decode_policy, rcfg.local_prefill_max_tokens) == (
        "cache", "load", 64)
    assert (rcfg.prefill_hit_weight, rcfg.decode_hit_weight) == (1.0, 1.0)
    weighted = from_mapping({"prefill": 1, "decode": 1,
                             "router": {"decode_hit_weight": 0.25, "prefill_hit_weight": 2}})
    argv = router_argv(weighted, str(tmp_path), "127.0.0.1",
                       {"prefill": ["http://p:1"], "decode": ["http://d:1"]})
    rcfg = router_config(p.parse_args(argv[argv.index("router") + 1:]))
    assert (rcfg.prefill_hit_weight, rcfg.decode_hit_weight) == (2.0, 0.25)
    with pytest.raises(ValueError, match="weights must not be negative"):
        DeploymentConfig(prefill=1, decode=1, decode_hit_weight=-1)


def test_the_router_and_the_workers_drain_within_the_deployments_stop_timeout(
        tmp_path: Path) -> None:
    """The launcher SIGKILLs a stage `stop_timeout_s` + `EXIT_S` after its SIGTERM: the
    router's drain and vLLM's shutdown are bounded by `stop_timeout_s`, not their own longer
    defaults (30 s each), so neither is killed mid-drain."""
    import argparse

    from splitserve.launch.local import pool_worker_config, router_argv
    from splitserve.router.cli import add_router_arguments
    from splitserve.router.cli import config_from_args as router_config
    from splitserve.worker.launch import worker_command

    cfg = from_mapping({"prefill": 1, "decode": 1, "stop_timeout_s": 12})
    argv = router_argv(cfg, str(tmp_path), "127.0.0.1",
                       {"prefill": ["http://p:1"], "decode": ["http://d:1"]})
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    assert router_config(p.parse_args(argv[argv.index("router") + 1:])).drain_timeout_s == 12
    wcfg = pool_worker_config(cfg, Role.DECODE, str(tmp_path), None, "127.0.0.1", None)
    worker_argv, env = worker_command(wcfg, "token")
    remove_worker_dir(env)
    assert worker_argv[worker_argv.index("--shutdown-timeout") + 1] == "12"


def test_several_routers_each_name_the_others_as_peers(tmp_path: Path) -> None:
    """`--routers 3`: ports 9000-9002; each router's command line names the other two."""
    import argparse

    from splitserve.launch.cli import config_from_args, register
    from splitserve.launch.local import LocalDeployment, router_argv
    from splitserve.router.cli import add_router_arguments
    from splitserve.router.cli import config_from_args as router_config

    top = argparse.ArgumentParser()
    register(top.add_subparsers())
    cfg = config_from_args(top.parse_args(["serve", "--prefill", "1", "--decode", "1",
                                           "--routers", "3", "--port", "9000"]))
    dep = LocalDeployment(cfg, say=lambda line: None)
    assert dep.urls == tuple(f"http://127.0.0.1:{p}" for p in (9000, 9001, 9002))
    assert dep.url == dep.urls[0]
    argv = router_argv(cfg, str(tmp_path), "127.0.0.1",
                       {"prefill": ["http://p:1"], "decode": ["http://d:1"]}, port=9001,
                       peers=(dep.urls[0], dep.urls[2]))
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    rcfg = router_config(p.parse_args(argv[argv.index("router") + 1:]))
    assert rcfg.port == 9001 and rcfg.peers == (dep.urls[0], dep.urls[2])
    assert rcfg.prefill == ("http://p:1",)  # --peer's list ends before the next flag
    twice = router_config(p.parse_args(["--prefill", "http://p:1", "--decode", "http://d:1",
                                        "--peer", "http://a:1", "--peer", "http://b:1"]))
    assert twice.peers == ("http://a:1", "http://b:1")  # repeated: every one counts


def test_serve_takes_the_operators_token_else_makes_one(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`SPLITSERVE_TOKEN_FILE` (or `SPLITSERVE_TOKEN`) in serve's environment is the deployment's
    token, so a Prometheus given the same file can scrape the workers; else a fresh one."""
    from splitserve.launch.local import LocalDeployment

    cfg = DeploymentConfig(prefill=1, decode=1, log_dir=str(tmp_path))
    monkeypatch.delenv("SPLITSERVE_TOKEN", raising=False)
    monkeypatch.delenv("SPLITSERVE_TOKEN_FILE", raising=False)
    fresh = {LocalDeployment(cfg, say=lambda line: None).token for _ in range(2)}
    assert len(fresh) == 2 and all(t and len(t) >= 32 for t in fresh)
    secret = tmp_path / "token"
    secret.write_text("operator-chosen-token\n")
    monkeypatch.setenv("SPLITSERVE_TOKEN_FILE", str(secret))
    assert LocalDeployment(cfg, say=lambda line: None).token == "operator-chosen-token"


def test_cores_this_process_may_not_use_are_refused_on_construction() -> None:
    usable = sorted(os.sched_getaffinity(0))
    beyond = (usable[-1] + 1, usable[-1] + 2, usable[-1] + 4)
    with pytest.raises(ValueError, match=rf"^cpus: core\(s\) {beyond[0]}-{beyond[1]},"
                                         rf"{beyond[2]} not available to this process"):
        DeploymentConfig(colocated=1, cpus=(usable[0], *beyond))
    with pytest.raises(ValueError, match=rf"^router_cpus: core\(s\) {beyond[0]} not available"):
        from_mapping({"colocated": 1, "router_cpus": [beyond[0]]})
    assert DeploymentConfig(colocated=1, cpus=tuple(usable), router_cpus=(usable[0],)).cpus
    # the Ray backend's cores are its nodes', not this process's
    assert DeploymentConfig(colocated=1, backend="ray", cpus=beyond).cpus == beyond


def test_serve_refuses_cores_it_may_not_use_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.cli import main

    beyond = max(os.sched_getaffinity(0)) + 1
    assert main(["serve", "--colocated", "1", "--router-cpus", str(beyond)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve serve: router_cpus: core(s) {beyond} not available to "
                          "this process (it may use "), err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_a_stop_or_a_closed_terminal_stops_the_deployment(
        signum: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sets the stop and interrupts `serve`'s wait, whose `finally` drains and stops the
    deployment; after SIGHUP what `serve` still says goes to /dev/null (the terminal is gone,
    and a failed write must not skip the stop)."""
    import io
    import sys
    import threading

    from splitserve.launch.cli import STOP_SIGNALS, on_stop_signal

    assert signum in STOP_SIGNALS
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    stop = threading.Event()
    with pytest.raises(KeyboardInterrupt):
        on_stop_signal(stop, signum, None)
    assert stop.is_set()
    if signum == signal.SIGHUP:
        assert sys.stdout is not out and sys.stdout.name == os.devnull
        print("splitserve: stopping")  # goes nowhere, raises nothing
        sys.stdout.close()
    else:
        assert sys.stdout is out and sys.stderr is err
