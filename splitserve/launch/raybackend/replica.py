"""One pool member as a Ray Serve replica: it runs the same worker process as the local
launcher (`worker_command`: vLLM's OpenAI server with splitserve's connector) under a group
guard, and tells the directory where it is.

Invariants:
- The worker and everything it starts live in one process group led by `guard`, which dies
  with this replica (PR_SET_PDEATHSIG) and takes the group with it; `stop()` SIGTERMs the
  group, SIGKILLs it after the worker's drain, and is the only way this replica ends a worker;
  it then removes the worker's private directory (`remove_worker_dir`), as does a start whose
  process never ran.
- The worker binds its HTTP and KV ports on this node's IP; its cores are claimed from the
  directory per machine and set both as its affinity and as vLLM's OpenMP binding (Ray's own
  `OMP_NUM_THREADS=1` for actors is overridden by `worker_command`).
- The token reaches the worker in its process environment only (read from the directory by an
  actor call): not in argv, `runtime_env` or any Ray metadata.
- Stopping drains first: the replica leaves the router's rotation (directory `drain`, acted on
  by the router host), waits until the router let it go and the worker runs nothing and stages
  nothing, then stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from splitserve.common.guard import GRACE_ENV, guarded
from splitserve.common.privatedir import remove_worker_dir
from splitserve.common.procs import stop_group
from splitserve.common.vocab import Pool
from splitserve.common.wire import ConnectorState, WorkerLoad
from splitserve.config import bearer_headers
from splitserve.launch.config import DeploymentConfig
from splitserve.launch.local import pool_worker_config
from splitserve.worker.launch import wait_healthy, worker_command
from splitserve.worker.load import LOAD_PATH

HEALTH_FAILURES = 3


def node_model(cfg: DeploymentConfig) -> tuple[str, str | None]:
    """(directory, served name) of the deployment's model on this node: the embedded model
    built here, a directory, or a hub id's snapshot of `cfg.revision`, which the driver pinned
    to one commit (`deployment.pin_revision`): every node loads the same files."""
    if cfg.model == "embedded":
        from splitserve.demo_model import embedded_model_dir

        return str(embedded_model_dir()), "splitserve-demo"
    from splitserve.hub import resolve_model

    source = resolve_model(cfg.model, cfg.revision)
    return source.path, source.name


def log_path(cfg: DeploymentConfig, name: str) -> Path:
    root = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.gettempdir()) / "splitserve-ray"
    path = root / cfg.ray.name / f"{name.replace('::', '-').replace('#', '-')}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class WorkerReplica:
    """A Serve deployment class (see `deployment.pool_app`)."""

    def __init__(self, cfg: DeploymentConfig, kind: str, directory: str) -> None:
        import ray
        from ray import serve

        self.cfg = cfg
        self.kind = kind
        self.directory = ray.get_actor(directory, namespace=cfg.ray.namespace)
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        token, _ = ray.get(self.directory.secrets.remote())
        self.token: str | None = token
        node_ip = ray.util.get_node_ip_address()
        cores = ray.get(self.directory.claim_cores.remote(
            node_ip, sorted(os.sched_getaffinity(0)), cfg.ray.worker_cpus * cfg.tp_of(kind),
            self.name))
        try:
            self._start(node_ip, tuple(cores))
        except BaseException:  # a replica that never registers gives its cores back here
            ray.get(self.directory.deregister.remote(self.name))
            raise
        self.client = httpx.AsyncClient(headers=bearer_headers(token), timeout=2.0)
        self.health_failures = 0

    def _start(self, node_ip: str, cores: tuple[int, ...]) -> None:
        """Start the worker under its guard, wait until it is healthy, register it."""
        import ray

        cfg, token = self.cfg, self.token
        model_dir, served_name = node_model(cfg)
        self.wcfg = pool_worker_config(cfg, Pool(self.kind).worker_role, model_dir,
                                       served_name, node_ip, cores)
        argv, env = worker_command(self.wcfg, token)
        self.worker_env = env
        env[GRACE_ENV] = str(self.wcfg.shutdown_timeout_s + 5)
        self.log = log_path(cfg, self.name)
        cpus = self.wcfg.cpus

        def setup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        try:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    guarded(argv),
                    env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=setup,
                    start_new_session=True)
        except BaseException:  # never ran: stop() will not be called for it
            remove_worker_dir(env)
            raise
        try:
            wait_healthy(self.wcfg.url, self.proc, cfg.startup_timeout_s, token)
        except BaseException:
            self.stop(grace_s=0)
            raise
        ray.get(self.directory.register.remote({
            "replica": self.name, "kind": self.kind, "url": self.wcfg.url,
            "node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip,
            "cores": cores}))

    def describe(self) -> dict[str, Any]:
        return {"replica": self.name, "kind": self.kind, "url": self.wcfg.url,
                "pid": self.proc.pid, "log": str(self.log)}

    async def check_health(self) -> None:
        """Serve's health check: the worker process lives, and `/health` has not failed
        `HEALTH_FAILURES` checks in a row (one slow answer on a busy core is not a death)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with code {self.proc.returncode} (log {self.log})")
        try:
            r = await self.client.get(f"{self.wcfg.url}/health", timeout=5.0)
            error = None if r.status_code == 200 else f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            error = f"/health: {type(exc).__name__}"
        self.health_failures = 0 if error is None else self.health_failures + 1
        if error is not None and self.health_failures >= HEALTH_FAILURES:
            raise RuntimeError(error)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's autoscaling signals (see `autoscale`)."""
        if self.kind == Pool.PREFILL:
            load = await self.directory.router_load.remote(self.wcfg.url)
            return {"queued_prompt_tokens": float(load.get("inflight_prefill_tokens", 0.0))}
        r = await self.client.get(f"{self.wcfg.url}{LOAD_PATH}")
        gauges = WorkerLoad.from_json(r.json()) if r.status_code == 200 else WorkerLoad()
        return {"running": gauges.running or 0.0, "kv_usage": gauges.kv_usage or 0.0}

    async def _idle(self) -> bool:
        """Whether the worker holds nothing another part still needs: no request running or
        waiting, and with splitserve's connector no KV staged for D's engine (D) and no
        blocks held for a D that has not acknowledged its load (P)."""
        try:
            load = WorkerLoad.from_json(
                (await self.client.get(f"{self.wcfg.url}{LOAD_PATH}")).json())
            held = 0
            if self.kind in (Pool.PREFILL, Pool.DECODE):
                r = await self.client.get(f"{self.wcfg.url}/splitserve/state")
                if r.status_code == 200:  # 404: vLLM's own connectors
                    state = ConnectorState.from_json(r.json())
                    held = state.staged_bytes + state.held_sends
        except (httpx.HTTPError, ValueError):  # ValueError: not JSON, or WireError
            return True  # a worker that cannot answer holds nothing we could wait for
        return not load.running and not load.waiting and not held

    async def __del__(self) -> None:
        """Serve stops this replica (scale-down, redeploy, delete): drain, then stop."""
        deadline = time.monotonic() + self.cfg.ray.drain_timeout_s
        with contextlib.suppress(Exception):
            await self.directory.drain.remote(self.name)
            while time.monotonic() < deadline and not await self.directory.drained.remote(
                    self.name):
                await asyncio.sleep(0.2)
            while time.monotonic() < deadline and not await self._idle():
                await asyncio.sleep(0.2)
        await asyncio.to_thread(self.stop, self.wcfg.shutdown_timeout_s + 5)
        with contextlib.suppress(Exception):
            await self.directory.deregister.remote(self.name)
            await self.client.aclose()

    def stop(self, grace_s: float) -> None:
        """SIGTERM the guard (it passes the signal on to the worker), SIGKILL the whole group
        after `grace_s`."""
        # the guard alone: a group-wide SIGTERM would reach its sentinel, which SIGKILLs the group
        stop_group(self.proc, grace_s, term="leader", sweep=True, reap_s=5.0)
        remove_worker_dir(self.worker_env)
