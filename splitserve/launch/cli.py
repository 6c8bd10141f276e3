"""`splitserve serve`: start workers and the router locally, wait until healthy, run until
Ctrl-C/SIGTERM, then stop every process."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from splitserve.common.cpus import cpus_flag
from splitserve.common.ports import check_port_free
from splitserve.common.refusal import refusing
from splitserve.common.vocab import Connector, values
from splitserve.config import ConnectorConfig
from splitserve.connector.tls import client_context, server_context
from splitserve.hub import check_model_dir
from splitserve.launch.backend import LauncherBackend
from splitserve.launch.config import DeploymentConfig, from_mapping, load_yaml
from splitserve.launch.local import LocalDeployment
from splitserve.router.config import DECODE_POLICIES, PREFILL_POLICIES
from splitserve.secretflags import add_secret_guards
from splitserve.worker.cli import (
    add_kv_events_argument,
    add_speculative_argument,
    add_tls_arguments,
)
from splitserve.worker.kv_transfer import check_mooncake_installed, check_nixl_installed
from splitserve.worker.launch import (
    check_kv_fits,
    gpu_connector_warning,
)


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    model = "embedded" if args.embedded else args.model
    return {
        "prefill": args.prefill, "decode": args.decode, "colocated": args.colocated,
        "model": model, "revision": args.revision, "dtype": args.dtype,
        "transport": args.transport, "connector": args.connector, "kv_lease_s": args.kv_lease,
        "host": args.host,
        "port": args.port, "routers": args.routers,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib,
        "cpus": args.cpus, "router_cpus": args.router_cpus, "log_dir": args.log_dir,
        "unsplittable": args.unsplittable, "prefill_policy": args.prefill_policy,
        "decode_policy": args.decode_policy,
        "local_prefill_max_tokens": args.local_prefill_max_tokens,
        "prefill_hit_weight": args.prefill_hit_weight, "decode_hit_weight": args.decode_hit_weight,
        "worker_args": tuple(args.vllm_args) or None, "kv_tls_cert": args.kv_tls_cert,
        "kv_tls_key": args.kv_tls_key, "kv_tls_ca": args.kv_tls_ca,
        "backend": "ray" if args.ray is not None else None,
        "ray_address": args.ray or None,
        "kv_events": args.kv_events,  # None unless --no-kv-events: the YAML's value stands
        "speculative": args.speculative_config,
        "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
        "colocated_tp": args.colocated_tp,
    }


def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    overrides = overrides_from_args(args)
    if args.config:
        return load_yaml(args.config, overrides)
    return from_mapping({}, overrides)


def check_can_start(cfg: DeploymentConfig) -> None:
    """What would stop the deployment part-way, checked before anything starts: the routers'
    ports taken, Ray or nixl not installed. Raises ValueError saying what to do."""
    if cfg.files_here:  # the routers listen on this machine
        for port in cfg.router_ports:
            check_port_free(cfg.host, port, "--port")
    if cfg.backend == "ray":
        try:
            import ray  # noqa: F401
            from ray import serve  # noqa: F401
        except ImportError:
            raise ValueError("--ray needs Ray (with Ray Serve), which is not installed: "
                             "pip install 'splitserve[ray]'") from None
    elif cfg.connector == Connector.NIXL and (cfg.prefill or cfg.decode):
        check_nixl_installed()
    elif cfg.connector == Connector.MOONCAKE and (cfg.prefill or cfg.decode):
        check_mooncake_installed()
    if cfg.backend == "local" and Path(cfg.model).is_dir():  # a hub id: the workers tell
        check_model_dir(cfg.model)
        check_kv_fits(cfg.model, cfg.max_model_len, cfg.kv_cache_gib, cfg.dtype,
                      cfg.worker_args, max(cfg.prefill_tp, cfg.decode_tp, cfg.colocated_tp))


def make_backend(cfg: DeploymentConfig) -> LauncherBackend:
    def say(line: str) -> None:
        print(line, flush=True)

    if cfg.backend == "ray":
        from splitserve.launch.raybackend.deployment import RayDeployment

        return RayDeployment(cfg, say=say)
    return LocalDeployment(cfg, say=say)


def run(args: argparse.Namespace) -> int:
    with refusing("serve"):  # everything checked before anything starts
        cfg = config_from_args(args)
        tls = ConnectorConfig(tls_cert=cfg.kv_tls_cert, tls_key=cfg.kv_tls_key,
                              tls_ca=cfg.kv_tls_ca)
        if cfg.files_here:  # unreadable or mismatched TLS files fail here, not in every worker
            server_context(tls)
            client_context(tls)
        warning = (gpu_connector_warning(cfg.connector, bool(cfg.prefill or cfg.decode))
                   if cfg.backend == "local" else None)
        if warning:  # a warning, not a refusal: the run that would first verify it
            print(f"splitserve serve: warning: {warning}", file=sys.stderr, flush=True)
        check_can_start(cfg)
        deployment = make_backend(cfg)
    stop = threading.Event()
    for sig in STOP_SIGNALS:  # SIGINT even where the shell started us ignoring it
        signal.signal(sig, functools.partial(on_stop_signal, stop))
    code = 0
    try:
        deployment.start()
        print("splitserve: Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            for line in deployment.tend():
                print(f"splitserve: {line}", file=sys.stderr, flush=True)
            dead = deployment.failures()
            if dead:
                names = ", ".join(dead)
                print(f"splitserve: {names} stopped; shutting the deployment down",
                      file=sys.stderr, flush=True)
                code = 1
                break
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"splitserve serve: {exc}", file=sys.stderr)
        code = 1
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        print("splitserve: stopping", flush=True)
        try:
            deployment.stop()  # raises RuntimeError naming what could not be stopped
        except RuntimeError as exc:
            print(f"splitserve serve: {exc}", file=sys.stderr)
            code = 1
        else:
            print("splitserve: stopped", flush=True)
    return code


# Ctrl-C, a stop, a closed terminal: each drains and stops the deployment
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def on_stop_signal(stop: threading.Event, signum: int, frame: FrameType | None) -> None:
    """Set `stop` and interrupt the main thread. After SIGHUP the terminal is gone: what is
    still said goes nowhere (a write to it would fail and skip the stop)."""
    if signum == signal.SIGHUP:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    stop.set()
    raise KeyboardInterrupt


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="start a deployment: workers and the router as local processes, or on "
                      "a Ray cluster (--ray)",
        description="Arguments after `--` go to every vLLM worker unchanged. Flags override "
                    "the values of --config.")
    p.add_argument("--config", help="deployment YAML file")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers")
    p.add_argument("--colocated", type=int, default=None, metavar="K",
                   help="colocated (plain vLLM) workers: the baseline")
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{pool}-tp", type=int, default=None, metavar="N",
                       help=f"tensor parallelism of each {pool} worker: N ranks, each on "
                            "cores of its own when there are enough, else sharing the worker's "
                            "(default 1)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help="model directory, or Hugging Face model id (org/name)")
    model.add_argument("--embedded", action="store_true",
                       help="the embedded demo model (the default)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face model id (default: main)")
    p.add_argument("--transport", choices=("tcp", "shm"), default=None)
    p.add_argument("--connector", choices=values(Connector), default=None,
                   help="KV connector: splitserve (default), nixl (vLLM's NixlConnector) or "
                        "mooncake (vLLM's MooncakeConnector)")
    p.add_argument("--kv-lease", type=float, default=None, metavar="S",
                   help="seconds KV no D claims is kept: D's staging lease (splitserve), "
                        "P's held blocks (nixl); default 60")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None, help="router port (default 8000)")
    p.add_argument("--routers", type=int, default=None, metavar="N",
                   help="N routers over the same workers, on ports PORT .. PORT+N-1; each "
                        "follows every worker's cache and counts the others' open requests "
                        "(default 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt and output (default: the model's own length)")
    p.add_argument("--kv-cache-gib", type=int, default=None,
                   help="each worker's KV cache in GiB, each rank's with TP "
                   "(VLLM_CPU_KVCACHE_SPACE; default 1)")
    p.add_argument("--cpus", type=cpus_flag, default=None, help="cores to use, e.g. 0-7")
    p.add_argument("--router-cpus", type=cpus_flag, default=None,
                   help="the router's cores (default: one of its own when there are more "
                        "cores than workers, else it shares all of them)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--unsplittable", choices=("whole", "refuse"), default=None)
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=None,
                   help="the router's choice of P (default cache)")
    p.add_argument("--decode-policy", choices=DECODE_POLICIES, default=None,
                   help="the router's choice of D (default cache)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                   help="prefill on D when the chosen D holds all but at most N prompt "
                        "tokens (default 128; 0: never)")
    p.add_argument("--prefill-hit-weight", type=float, default=None, metavar="W",
                   help="cache policy, P: a cached prompt token counts as W tokens not to "
                        "compute (default 1)")
    p.add_argument("--decode-hit-weight", type=float, default=None, metavar="W",
                   help="cache policy, D: a whole prompt cached is worth W of load's score "
                        "(default 1)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray: the cluster at ADDRESS (host:port of its GCS), or a local "
                        "one started for the deployment when ADDRESS is omitted")
    add_speculative_argument(p)
    add_kv_events_argument(p, default=None)
    add_tls_arguments(p)
    add_secret_guards(p)
    p.set_defaults(func=run, vllm_args=[])
