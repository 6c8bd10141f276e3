"""`RayDeployment`: a deployment on a Ray cluster. Each pool (P, D, colocated) is one Ray Serve
application whose replicas are `WorkerReplica`s, placed by the pool's custom resources and
autoscaled by its own policy; each router (`routers: N`) is a `RouterHost` actor; a
`WorkerDirectory` actor joins them.

Invariants:
- Without an address, a single-node Ray cluster is started for the deployment, on 127.0.0.1,
  with the custom resources the pools ask for, and shut down by `stop()`: never a cluster
  `ray.init()` would find on the machine (`RAY_ADDRESS`, the last one started there).
- Serve's own HTTP proxy stays off: the router is the only front door.
- The driver hands the token and API key to the directory by an actor call; nothing secret is
  in a deployment's init arguments, `runtime_env`, or argv.
- A hub id's revision is resolved once, by the driver, to the commit it names now; replicas
  and the router load that commit's snapshot on their node (`pin_revision`).
- `ray.name` names the deployment's actors and pools: a start that finds its directory's name
  taken (in its namespace) or its pools' names (on the cluster) fails at once and touches
  nothing of the deployment that holds them.
- A pool whose first replicas are not all placed on nodes within `startup_timeout_s` of its
  deployment (resources, cores, `max_replicas_per_node`) fails the start with a TimeoutError
  naming it; a placed replica's load is bounded by the replica itself.
- `stop()` drains front to back: the router first, then each pool's replicas (each drains
  itself; one no node holds yet runs no worker and is killed), then the directory; whatever
  it started, it ends. Each step runs even when an earlier one failed; a failure (other than
  a part that is gone already) is told through `say` and raised as one `RuntimeError` once
  every step ran.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from splitserve.config import load_token, new_token
from splitserve.launch.backend import LauncherBackend
from splitserve.launch.config import DeploymentConfig
from splitserve.launch.raybackend.autoscale import autoscaling_config

KINDS = ("prefill", "decode", "colocated")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a local Ray stays on 127.0.0.1
PUSH_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"


def pool_sizes(cfg: DeploymentConfig) -> dict[str, int]:
    return {k: n for k, n in zip(KINDS, (cfg.prefill, cfg.decode, cfg.colocated), strict=True)
            if n}


def local_cluster_resources(cfg: DeploymentConfig) -> dict[str, float]:
    """Enough of every custom resource the pools name for each pool's maximum, on one node."""
    out: dict[str, float] = {}
    for kind, n in pool_sizes(cfg).items():
        top = cfg.ray.bounds(kind, n)[1] if kind != "colocated" else n
        for name, amount in cfg.ray.resources(kind).items():
            out[name] = out.get(name, 0.0) + amount * top
    for name, amount in cfg.ray.router_resources:
        out[name] = out.get(name, 0.0) + amount
    return out


def app_of(replica: str) -> str:
    """The Serve application of a replica's full id ("SERVE_REPLICA::<app>#<deployment>#<id>")."""
    return replica.rpartition("::")[2].split("#", 1)[0]


def pin_revision(cfg: DeploymentConfig) -> DeploymentConfig:
    """`cfg` with a hub id's revision (a branch, a tag, or none: main) replaced by the commit
    it resolves to here, so that a branch moving while replicas start cannot give two nodes
    different weights. The embedded model and directories are returned as they are."""
    if cfg.model == "embedded" or Path(cfg.model).is_dir():
        return cfg
    from splitserve.hub import resolve_model

    return replace(cfg, revision=resolve_model(cfg.model, cfg.revision).revision)


def pool_app(cfg: DeploymentConfig, kind: str, n: int, directory: str) -> Any:
    """The Serve application of one pool: `n` replicas (or autoscaling from `n`)."""
    from ray import serve

    from splitserve.launch.raybackend.replica import WorkerReplica

    opts = cfg.ray
    auto = autoscaling_config(kind, opts.bounds(kind, n) if kind != "colocated" else (n, n),
                              opts, hold_s=cfg.startup_timeout_s)
    options: dict[str, Any] = {
        "name": kind,
        "ray_actor_options": {
            # a replica of TP N runs N ranks, each on worker_cpus cores of one node
            "num_cpus": opts.worker_cpus * cfg.tp_of(kind), "resources": opts.resources(kind),
            # not a secret: how often replicas report their autoscaling signals
            "runtime_env": {"env_vars": {PUSH_ENV: str(opts.metrics_push_interval_s)}}},
        "health_check_period_s": opts.health_check_period_s,
        "health_check_timeout_s": 10.0,
        "graceful_shutdown_wait_loop_s": 0.2,
        # the replica's own drain, then the worker's
        "graceful_shutdown_timeout_s": opts.drain_timeout_s + cfg.stop_timeout_s + 40,
        "max_ongoing_requests": 1000,
    }
    if opts.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = opts.max_replicas_per_node
    if auto is None:
        options["num_replicas"] = n
    else:
        options["autoscaling_config"] = auto
    deployment = serve.deployment(WorkerReplica).options(**options)
    return deployment.bind(cfg, kind, directory)


class RayDeployment(LauncherBackend):
    """`start()` deploys the pools and the router and returns the router's URL."""

    def __init__(self, cfg: DeploymentConfig, say: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.say = say
        # the operator's (for scrapers of the workers' /metrics), else a fresh one
        self.token = load_token(required=False) or new_token()
        self.api_key = os.environ.get("SPLITSERVE_API_KEY") or None
        self.names = {"directory": f"{cfg.ray.name}-directory"}
        self.router_names = [f"{cfg.ray.name}-router" + (str(i) if i else "")
                             for i in range(cfg.routers)]
        self.apps = [f"{cfg.ray.name}-{kind}" for kind in pool_sizes(cfg)]
        self.started_cluster = False
        self.deployed_pools = False  # this deployment's pools were sent to Serve: stop() deletes
        self.directory: Any = None
        self.routers: list[Any] = []
        self._urls = tuple(f"http://{cfg.host}:{port}" for port in cfg.router_ports)
        self.lost: set[int] = set()  # routers of several that were found gone
        self.startup_s: dict[str, float] = {}

    @property
    def url(self) -> str:
        return self._urls[0]

    @property
    def urls(self) -> tuple[str, ...]:
        return self._urls

    def _connect(self) -> None:
        cfg = self.cfg
        if cfg.ray_address is None:
            os.environ.setdefault(LOOPBACK_ENV, "0")
        import ray

        if ray.is_initialized():
            return
        if cfg.ray_address is None:  # "local": a new cluster, never one found on the machine
            ray.init(address="local", namespace=cfg.ray.namespace, include_dashboard=False,
                     resources=local_cluster_resources(cfg), log_to_driver=False,
                     _node_ip_address="127.0.0.1")
            self.started_cluster = True
        else:
            ray.init(address=cfg.ray_address, namespace=cfg.ray.namespace,
                     log_to_driver=False)

    def start(self) -> str:
        if self.directory is not None:
            raise RuntimeError("this deployment is already started")
        t0 = time.monotonic()
        try:
            self.cfg = pin_revision(self.cfg)
            self._connect()
            self.startup_s["cluster"] = time.monotonic() - t0
            self._deploy(t0)
        except BaseException as exc:
            try:
                self.stop()
            except RuntimeError as stop_failed:
                exc.add_note(str(stop_failed))
            raise
        self.say(f"splitserve: ready — OpenAI endpoint {self.url}/v1 on Ray "
                 f"({', '.join(f'{n} {k}' for k, n in pool_sizes(self.cfg).items())}; "
                 f"{self.startup_s['ready']:.1f} s)")
        return self.url

    def _deploy(self, t0: float) -> None:
        import ray
        from ray import serve
        from ray.exceptions import ActorAlreadyExistsError
        from ray.serve.api import RunTarget
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from splitserve.launch.raybackend.directory import WorkerDirectory
        from splitserve.launch.raybackend.routerhost import RouterHost

        cfg = self.cfg
        here = ray.get_runtime_context().get_node_id()
        pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
        # named actors live in the deployment's namespace, where replicas look them up, also
        # when the driver was already connected to Ray in another one
        try:
            self.directory = ray.remote(WorkerDirectory).options(
                name=self.names["directory"], namespace=cfg.ray.namespace, num_cpus=0,
                **pinned).remote()
        except ActorAlreadyExistsError as exc:
            raise RuntimeError(
                f"a splitserve deployment named {cfg.ray.name!r} already runs on this Ray "
                f"cluster (namespace {cfg.ray.namespace!r}): stop it, or give this one another "
                "ray.name") from exc
        ray.get(self.directory.set_secrets.remote(self.token, self.api_key))
        serve.start(proxy_location="Disabled")
        taken = sorted(set(self.apps) & set(serve.status().applications))
        if taken:  # Serve's application names are the cluster's, whatever the namespace
            raise RuntimeError(
                f"Ray Serve on this cluster already runs {', '.join(taken)}: another splitserve "
                f"deployment named {cfg.ray.name!r}; stop it, or give this one another ray.name")
        self.say(f"splitserve: Ray {ray.get_runtime_context().gcs_address}; deploying "
                 + ", ".join(f"{n} {k}" for k, n in pool_sizes(cfg).items()))
        targets = [RunTarget(pool_app(cfg, kind, n, self.names["directory"]),
                             name=f"{cfg.ray.name}-{kind}", route_prefix=None)
                   for kind, n in pool_sizes(cfg).items()]
        self.deployed_pools = True
        serve.run_many(targets, wait_for_applications_running=False)
        self._wait_running(time.monotonic() + cfg.startup_timeout_s)  # placement's deadline
        self.startup_s["workers"] = time.monotonic() - t0
        router_opts: dict[str, Any] = {"namespace": cfg.ray.namespace, "num_cpus": 0}
        if cfg.ray.router_resources:
            router_opts["resources"] = cfg.ray.resources("router")
        else:
            router_opts.update(pinned)
        self.routers = [ray.remote(RouterHost).options(name=name, **router_opts).remote(
            cfg, self.names["directory"], i) for i, name in enumerate(self.router_names)]
        starts = [r.start.remote(cfg.startup_timeout_s) for r in self.routers]
        waiting = list(starts)
        while waiting:  # the first router to fail ends the start, whatever its place
            done, waiting = ray.wait(waiting, num_returns=1)
            ray.get(done)
        self._urls = tuple(ray.get(starts))
        self.startup_s["ready"] = time.monotonic() - t0

    def workers(self) -> list[dict[str, Any]]:
        """The directory's live workers (kind, url, node, cores, draining)."""
        import ray

        return list(ray.get(self.directory.snapshot.remote()))

    def history(self) -> list[dict[str, Any]]:
        import ray

        return list(ray.get(self.directory.history.remote()))

    def _router_down(self, i: int) -> str | None:
        """Why router `i` no longer serves; None while it does."""
        import ray

        try:
            return None if ray.get(self.routers[i].alive.remote(), timeout=10) else \
                "its process exited"
        except Exception as exc:  # the actor or its node is gone
            return f"its actor is gone: {type(exc).__name__}"

    def tend(self) -> list[str]:
        """A router of several that is gone is told once; its peers serve on (the clients of
        its URL move to theirs). It is not started again."""
        if len(self.routers) < 2:
            return []
        lines = []
        for i in sorted(set(range(len(self.routers))) - self.lost):
            why = self._router_down(i)
            if why is not None and len(self.lost) + 1 < len(self.routers):
                self.lost.add(i)
                lines.append(f"router {self._urls[i]} stopped ({why}); "
                             f"{len(self.routers) - len(self.lost)} router(s) serve on")
        return lines

    def failures(self) -> list[str]:
        """The last router standing stopped (a router of several is `tend`'s)."""
        down = []
        for i in sorted(set(range(len(self.routers))) - self.lost):
            why = self._router_down(i)
            if why is None:
                return []
            down.append(f"the router {self._urls[i]}: {why}")
        return down

    def stop(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        from ray import serve
        from ray.exceptions import RayActorError

        problems: list[str] = []

        def attempt(what: str, step: Callable[[], object]) -> None:
            try:
                step()
            except RayActorError:
                pass  # the actor, or its node, is gone already: nothing of it is left to stop
            except Exception as exc:
                problems.append(f"{what}: {type(exc).__name__}: {exc}")
                self.say(f"splitserve: stopping {what} failed: {type(exc).__name__}: {exc}")

        if self.routers:
            routers, self.routers = self.routers, []
            attempt("the routers", lambda: ray.get([r.stop.remote() for r in routers],
                                                   timeout=self.cfg.stop_timeout_s + 15))
            for router in routers:
                attempt("a router actor", functools.partial(ray.kill, router))
            if self.directory is not None:
                directory = self.directory
                attempt("the directory", lambda: ray.get(directory.router_stopped.remote(),
                                                         timeout=10))
        if self.deployed_pools:  # never another deployment's pools (see the invariants)
            for app in self.apps:  # every pool drains at once
                attempt(f"pool {app}", functools.partial(serve.delete, app, _blocking=False))
            attempt("the pools", self._wait_deleted)
            self.deployed_pools = False
        if self.directory is not None:
            directory = self.directory
            attempt("the directory actor", lambda: ray.kill(directory))
            self.directory = None
        if self.started_cluster:
            attempt("Ray Serve", serve.shutdown)
            ray.shutdown()
            self.started_cluster = False
        if problems:
            raise RuntimeError("the Ray deployment did not stop cleanly: " + "; ".join(problems))

    def _wait_running(self, deadline: float) -> None:
        """Until every pool's application runs: RuntimeError when one failed to deploy;
        TimeoutError past `deadline` (monotonic) while a pool has fewer replicas placed on
        nodes than it starts with, with what Serve says of each pending pool."""
        import ray
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        sizes = {f"{self.cfg.ray.name}-{kind}": n for kind, n in pool_sizes(self.cfg).items()}
        while True:
            apps = serve.status().applications
            pending: dict[str, str] = {}
            for name in self.apps:
                app = apps.get(name)
                if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
                    raise RuntimeError(f"pool {name} failed to deploy: {app.message}")
                if app is None or app.status != ApplicationStatus.RUNNING:
                    said = [] if app is None else [app.message, *(
                        d.message for d in app.deployments.values())]
                    pending[name] = " ".join(m for m in said if m) or "not deployed yet"
            if not pending:
                return
            if time.monotonic() > deadline:
                placed = [app_of(r) for r in ray.get(self.directory.placed.remote())]
                unplaced = {name: why for name, why in pending.items()
                            if placed.count(name) < sizes[name]}
                if unplaced:
                    raise TimeoutError(
                        f"pools not placed on nodes within startup_timeout_s "
                        f"({self.cfg.startup_timeout_s:.0f} s): "
                        + "; ".join(f"{name}: {why}" for name, why in unplaced.items()))
            time.sleep(0.5)

    def _kill_unplaced(self) -> None:
        """Kill this deployment's replicas that no node holds (pending placement, or started
        and not yet claiming cores: no worker of theirs runs). Serve would wait out each one's
        graceful shutdown timeout for an actor that never answers, and replaces one that
        fails to start until it has processed the delete: hence called on every poll while
        the pools delete. Pinned (Ray Serve 2.x): a replica's actor is named
        `SERVE_REPLICA::<app>#<deployment>#<id>` in namespace `serve`."""
        import ray

        if self.directory is None:
            return
        ours = tuple(f"SERVE_REPLICA::{app}#" for app in self.apps)
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "serve" and a["name"].startswith(ours)]
        if not named:
            return
        placed = set(ray.get(self.directory.placed.remote(), timeout=10))  # after the listing
        for name in named:
            if name in placed:
                continue
            try:
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            except ValueError:
                pass  # gone already

    def _wait_deleted(self) -> None:
        """Until no pool's application is left (each placed replica drains, then stops; one
        no node holds is killed)."""
        from ray import serve

        limit = self.cfg.ray.drain_timeout_s + self.cfg.stop_timeout_s + 60
        deadline = time.monotonic() + limit
        while set(self.apps) & set(serve.status().applications):
            self._kill_unplaced()
            if time.monotonic() > deadline:
                raise TimeoutError(f"pools still deleting after {limit:.0f} s")
            time.sleep(0.5)
