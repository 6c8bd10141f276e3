"""Run a deployment as local processes: workers, then the router, each in its own session.

Invariants:
- The deployment token is the operator's (`SPLITSERVE_TOKEN` or `SPLITSERVE_TOKEN_FILE`, e.g.
  shared with a Prometheus that scrapes the workers), else generated here; it reaches children
  only in their environment.
- Every child runs in its own process group and gets SIGKILL if this process dies
  (PR_SET_PDEATHSIG); a worker runs under a guard (`common.guard`), which takes the worker's
  whole group down with it (vLLM's engine processes do not die with their API server).
  `stop()` stops the routers, then the workers: each stage's groups get
  SIGTERM, which drains each process for up to `stop_timeout_s` (the router's
  `--drain-timeout`, vLLM's `--shutdown-timeout`), and SIGKILL `EXIT_S` later, so no process
  outlives the deployment. A group leader not reaped even
  after its SIGKILL makes `stop()` raise `RuntimeError` naming it, once the rest is stopped.
- A worker's private directory (`worker_command`'s) is removed once its process is stopped,
  or at once when its process never started.
- `start()` waits for the workers side by side; the first that fails ends the wait at once
  (whichever worker it is), and every part started is stopped.
- Each worker gets its own cores when there are enough; otherwise cores are spread evenly and
  `LocalDeployment.core_note` says so.
- With several routers (`routers: N`), router i listens on `port + i` and names the others its
  peers; one that exits is started again on its port (`tend`), up to `ROUTER_RESTARTS` times,
  while the others serve. A single router that exits ends the deployment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from splitserve.common.guard import GRACE_ENV, guarded
from splitserve.common.privatedir import remove_worker_dir
from splitserve.common.procs import stop_groups
from splitserve.common.vocab import Connector, Pool, Role, values
from splitserve.config import TOKEN_ENV, WorkerConfig, load_token, new_token
from splitserve.hub import resolve_model
from splitserve.launch.backend import LauncherBackend
from splitserve.launch.config import DeploymentConfig
from splitserve.worker.diagnose import explain_log
from splitserve.worker.launch import (
    child_preexec,
    free_port,
    wait_healthy,
    worker_command,
)

ROUTER_RESTARTS = 5  # a router of several that exits more often than this ends the deployment
EXIT_S = 5.0  # a process's exit after its drain (closing connections, its engine, itself)


def last_log_line(path: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """The last line of a log that says something: not blank, not a traceback's indented
    frame or marker, not vLLM's "see root cause above"."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        text = re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip()
        if (not text.strip() or text[0].isspace() or "root cause above" in text
                or text.startswith(("Traceback", "During handling", "The above exception"))):
            continue
        return text if len(text) <= 300 else text[:297] + "..."
    return None


def router_argv(cfg: DeploymentConfig, model_dir: str, host: str,
                urls: dict[str, list[str]], *extra: str, port: int | None = None,
                peers: tuple[str, ...] = ()) -> list[str]:
    """The router's command line for a deployment: `urls` maps each pool ("prefill", "decode",
    "colocated") to its workers' URLs; `port` (default `cfg.port`); `peers`, the other routers'
    URLs; `extra` are further router flags."""
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--host", host,
            "--port", str(cfg.port if port is None else port), "--model", model_dir,
            "--prefill-policy", cfg.prefill_policy, "--decode-policy", cfg.decode_policy,
            "--local-prefill-max-tokens", str(cfg.local_prefill_max_tokens),
            "--prefill-hit-weight", str(cfg.prefill_hit_weight),
            "--decode-hit-weight", str(cfg.decode_hit_weight),
            "--unsplittable", cfg.unsplittable, "--max-inflight", str(cfg.max_inflight),
            # SIGTERM: in-flight requests get the deployment's stop timeout to finish
            "--drain-timeout", str(cfg.stop_timeout_s),
            "--log-level", "warning", *extra]
    for kind in values(Pool):
        if urls.get(kind):
            argv += [f"--{kind}", *urls[kind]]
    if peers:
        argv += ["--peer", *peers]
    return argv


@dataclass(frozen=True)
class CorePlan:
    router: tuple[int, ...]
    workers: tuple[tuple[int, ...], ...]
    note: str


def plan_cores(cores: list[int], n_workers: int, ranks: tuple[int, ...] | None = None
               ) -> CorePlan:
    """Disjoint cores per worker (and one for the router) when there are enough, else even.
    `ranks`: each worker's TP degree (default 1 each); a worker gets that many shares, so each
    of its ranks gets as many cores as a single-rank worker. With fewer cores than ranks but
    at least one a worker, each worker still gets cores of its own (apportioned by its ranks)
    and its ranks share them; only with fewer cores than workers do workers share cores."""
    ranks = ranks or (1,) * n_workers
    if len(ranks) != n_workers:
        raise ValueError("ranks needs one TP degree a worker")
    cores = sorted(cores)
    n, units = len(cores), sum(ranks)
    starts = [sum(ranks[:i]) for i in range(n_workers)]
    unit = "core(s) per rank" if units > n_workers else "core(s) per worker"
    if n >= units + 1:
        per = (n - 1) // units
        workers = tuple(tuple(cores[1 + s * per: 1 + (s + r) * per])
                        for s, r in zip(starts, ranks, strict=True))
        return CorePlan((cores[0],), workers, f"{per} {unit}, the router on core {cores[0]}")
    if n >= units:
        per = n // units
        workers = tuple(tuple(cores[s * per:(s + r) * per]) for s, r in zip(starts, ranks,
                                                                            strict=True))
        return CorePlan(tuple(cores), workers,
                        f"{per} {unit}; the router shares them (only {n} cores)")
    if n >= n_workers:
        # a worker's ranks share its own cores, never another worker's: a rank spinning on a
        # core another engine needs starves that engine (measured: P's NIXL handshake listener
        # waited out its 5 s timeout beside a spinning D rank)
        shares = _apportion(n, ranks)
        bounds = [sum(shares[:i]) for i in range(n_workers + 1)]
        workers = tuple(tuple(cores[bounds[i]:bounds[i + 1]]) for i in range(n_workers))
        return CorePlan(tuple(cores), workers,
                        f"only {n} cores for {units} ranks: each worker keeps its own cores and "
                        "its ranks share them, slower than a core a rank; the router shares "
                        "them all")
    workers = tuple(tuple(cores[(s + k) % n] for k in range(r)) if r <= n else tuple(cores)
                    for s, r in zip(starts, ranks, strict=True))
    return CorePlan(tuple(cores), workers,
                    f"only {n} cores for {units} ranks of {n_workers} workers: they share cores "
                    "round-robin, so they slow each other down")


def _apportion(n: int, ranks: tuple[int, ...]) -> list[int]:
    """`n` cores over workers of `ranks` ranks (len(ranks) <= n < sum(ranks)): one each, then
    one at a time to the worker with the most ranks per core so far (the first on ties)."""
    shares = [1] * len(ranks)
    for _ in range(n - len(ranks)):
        i = max(range(len(ranks)), key=lambda w: (ranks[w] / shares[w], -w))
        shares[i] += 1
    return shares


def pool_worker_config(cfg: DeploymentConfig, role: Role | None, model_dir: str,
                       served_name: str | None, host: str, cpus: tuple[int, ...] | None
                       ) -> WorkerConfig:
    """One pool member's worker, on free ports of `host` (a KV port a rank): the same for every
    backend."""
    tp = cfg.tp_of(role.value if role is not None else Pool.COLOCATED.value)
    return WorkerConfig(
        model=model_dir, port=free_port(host, avoid=cfg.router_ports), role=role, host=host,
        cpus=cpus, kv_port=free_port(host, tp, avoid=cfg.router_ports) if role else 0,
        connector=cfg.connector, transport=cfg.transport,  # type: ignore[arg-type]
        dtype=cfg.dtype, lease_s=cfg.kv_lease_s,
        kv_cache_gib=cfg.kv_cache_gib, max_model_len=cfg.max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        served_model_name=served_name,
        # SIGTERM: in-flight requests get the deployment's stop timeout to finish
        shutdown_timeout_s=max(1, int(cfg.stop_timeout_s)),
        staging_bytes=cfg.staging_mib * 1024**2, kv_events=cfg.kv_events,
        speculative_config=cfg.speculative if role != Role.PREFILL else None,
        tensor_parallel_size=tp,
        extra_args=cfg.worker_args,
        # one certificate for every connector worker (plain workers have no KV channel)
        kv_tls_cert=cfg.kv_tls_cert if role else None,
        kv_tls_key=cfg.kv_tls_key if role else None,
        kv_tls_ca=cfg.kv_tls_ca if role else None)


@dataclass
class Child:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]
    cpus: tuple[int, ...] | None
    restarts: int = 0

    @property
    def is_router(self) -> bool:
        return self.name.startswith("router")


def kv_kind(wcfg: WorkerConfig) -> str:
    """What a worker moves KV with, as the launcher prints it: the transport of splitserve's
    connector, else vLLM's connector's name."""
    return wcfg.transport if wcfg.connector == Connector.SPLITSERVE else wcfg.connector


class LocalDeployment(LauncherBackend):
    """`start()` brings every part up healthy and returns the router's URL; `stop()` ends all."""

    def __init__(self, cfg: DeploymentConfig, say: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.say = say
        # the operator's (for scrapers of the workers' /metrics), else a fresh one
        self.token = load_token(required=False) or new_token()
        self.children: list[Child] = []
        self.workers: list[WorkerConfig] = []
        self.model_dir = cfg.model  # the directory every worker and the router load
        self.served_name: str | None = None
        self.core_note = ""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = Path(cfg.log_dir or Path(".splitserve") / "logs" / f"{stamp}-{os.getpid()}")

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(f"http://{self.cfg.host}:{port}" for port in self.cfg.router_ports)

    def _popen(self, argv: list[str], env: dict[str, str], cpus: tuple[int, ...] | None,
               log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=child_preexec(cpus), start_new_session=True)

    def _spawn(self, name: str, url: str, argv: list[str], env: dict[str, str],
               cpus: tuple[int, ...] | None) -> Child:
        log = self.log_dir / f"{name}.log"
        child = Child(name, url, self._popen(argv, env, cpus, log), log, argv, env, cpus)
        self.children.append(child)
        return child

    def plan_workers(self) -> list[tuple[str, WorkerConfig]]:
        cfg = self.cfg
        cores = list(cfg.cpus or sorted(os.sched_getaffinity(0)))
        pools = ([Pool.PREFILL] * cfg.prefill + [Pool.DECODE] * cfg.decode
                 + [Pool.COLOCATED] * cfg.colocated)
        plan = plan_cores(cores, cfg.n_workers, tuple(cfg.tp_of(p.value) for p in pools))
        self.core_note = plan.note
        self.router_cpus = cfg.router_cpus or plan.router
        if cfg.router_cpus:
            self.core_note += (f"; --router-cpus puts the router on cpus "
                               f"{','.join(map(str, cfg.router_cpus))}")
        out = []
        for i, (pool, cpus) in enumerate(zip(pools, plan.workers, strict=True)):
            out.append((f"{pool.value}{i}", pool_worker_config(
                cfg, pool.worker_role, self.model_dir, self.served_name, cfg.host, cpus)))
        return out

    def start(self) -> str:
        if self.children:
            raise RuntimeError("this deployment is already started")
        cfg = self.cfg
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.model == "embedded":
            from splitserve.demo_model import embedded_model_dir

            self.model_dir, self.served_name = str(embedded_model_dir()), "splitserve-demo"
        else:  # one resolution: every worker and the router load the same snapshot
            source = resolve_model(cfg.model, cfg.revision)
            self.model_dir, self.served_name = source.path, source.name
        planned = self.plan_workers()
        self.say(f"splitserve: cores: {self.core_note}")
        try:
            for name, wcfg in planned:
                argv, env = worker_command(wcfg, self.token)
                env[TOKEN_ENV] = self.token
                # the guard's own deadline after it passes SIGTERM on: this one's (`stop`)
                env[GRACE_ENV] = str(cfg.stop_timeout_s + EXIT_S)
                try:
                    child = self._spawn(name, wcfg.url, guarded(argv), env, wcfg.cpus)
                except BaseException:  # never started: stop() will not know of it
                    remove_worker_dir(env)
                    raise
                self.workers.append(wcfg)
                self.say(f"splitserve: {name} {wcfg.url} cpus {','.join(map(str, wcfg.cpus or ()))}"
                         + (f" kv {kv_kind(wcfg)}"
                            f":{wcfg.kv_port}" if wcfg.role else "")
                         + f" (log {child.log})")
            self.say(f"splitserve: loading {len(self.children)} worker(s); each says when it "
                     "is ready")
            self._wait_workers(list(self.children))
            routers = self._start_routers(planned)
            for r in routers:  # a router is healthy once a P and a D (or a colocated) are up
                self._wait_ready(r, None, check=self._workers_alive)
        except BaseException as exc:
            try:
                self.stop()
            except RuntimeError as stop_failed:
                exc.add_note(str(stop_failed))
            raise
        shape = "+".join(f"{n}{k}" for n, k in ((cfg.prefill, "P"), (cfg.decode, "D"),
                                                 (cfg.colocated, " colocated")) if n)
        self.say(f"splitserve: ready — OpenAI endpoint {self.url}/v1 ({shape}, "
                 f"model {self.served_name or self.model_dir})"
                 + (f"; also {', '.join(u + '/v1' for u in self.urls[1:])}"
                    if len(self.urls) > 1 else ""))
        return self.url

    def _wait_workers(self, workers: list[Child]) -> None:
        """Wait for `workers` side by side until all are ready; the first to fail raises at
        once, whatever its place (`_wait_ready`'s error, naming it). The others' waits go on
        in their threads until their processes are stopped (the caller's `stop()`)."""
        pool = ThreadPoolExecutor(len(workers))
        try:
            futures = [pool.submit(self._wait_ready, c, self.token) for c in workers]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:  # the first failure among those done (all, when none)
                if future in done:
                    future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _wait_ready(self, child: Child, token: str | None,
                    check: Callable[[], None] | None = None) -> None:
        """Wait until `child` is healthy and say so; a failure (`check` raising included)
        names it and, when the cause is not recognised, the last meaningful line of its
        log."""
        started = time.monotonic()
        try:
            wait_healthy(child.url, child.proc, self.cfg.startup_timeout_s, token, child.log,
                         check)
        except (RuntimeError, TimeoutError) as exc:
            last = None if explain_log(child.log) else last_log_line(child.log)
            raise type(exc)(f"{child.name} did not start: {exc}"
                            + (f"; its log ends: {last}" if last else "")) from None
        self.say(f"splitserve: {child.name} ready ({time.monotonic() - started:.0f} s)")

    def _start_routers(self, planned: list[tuple[str, WorkerConfig]]) -> list[Child]:
        urls = {kind: [w.url for name, w in planned if name.startswith(kind)]
                for kind in values(Pool)}
        env = dict(os.environ)
        env[TOKEN_ENV] = self.token
        out = []
        for i, (port, url) in enumerate(zip(self.cfg.router_ports, self.urls, strict=True)):
            peers = tuple(u for u in self.urls if u != url)
            argv = router_argv(self.cfg, self.model_dir, self.cfg.host, urls, port=port,
                               peers=peers)
            name = "router" if self.cfg.routers == 1 else f"router{i}"
            child = self._spawn(name, url, argv, env, self.router_cpus)
            self.say(f"splitserve: {name} {url} cpus {','.join(map(str, self.router_cpus))} "
                     f"(log {child.log})")
            out.append(child)
        return out

    def _workers_alive(self) -> None:
        """RuntimeError naming the first worker that has exited (with its log)."""
        for c in self.dead():
            if not c.is_router:
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} (log {c.log})")

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def tend(self) -> list[str]:
        """Start a router of several that exited again, on its port, with its peers."""
        if self.cfg.routers == 1:
            return []
        lines = []
        for c in self.dead():
            if c.is_router and c.restarts < ROUTER_RESTARTS:
                code = c.proc.returncode
                c.proc = self._popen(c.argv, c.env, c.cpus, c.log)
                c.restarts += 1
                lines.append(f"{c.name} {c.url} exited ({code}); started again "
                             f"({c.restarts} of {ROUTER_RESTARTS}; log {c.log})")
        return lines

    def failures(self) -> list[str]:
        return [f"{c.name} (exit {c.proc.returncode}, log {c.log})" for c in self.dead()]

    def stop(self) -> None:
        """Graceful drain, front to back: SIGTERM the router and wait while it finishes its
        in-flight requests (it takes no new ones), then SIGTERM the workers, which drain what
        is left; SIGKILL whatever outlives its stage's `stop_timeout_s` + `EXIT_S`. Every part
        is stopped (and forgotten) before a leader not reaped after its SIGKILL is reported:
        `RuntimeError` naming it."""
        front = [c for c in self.children if c.is_router]
        stuck: list[str] = []
        stages: tuple[tuple[list[Child], Literal["group", "leader"]], ...] = (
            (front, "group"), ([c for c in self.children if c not in front], "leader"))
        for stage, term in stages:
            # a worker's guard passes SIGTERM on (its sentinel would SIGKILL the group at
            # once); sweep: a group may hold engine processes even after its leader exited
            codes = stop_groups([c.proc for c in stage], self.cfg.stop_timeout_s + EXIT_S,
                                term=term, sweep=True, reap_s=5.0)
            stuck += [f"{c.name} (pid {c.proc.pid}, log {c.log})"
                      for c, code in zip(stage, codes, strict=True) if code is None]
            for c in stage:
                if not c.is_router:
                    remove_worker_dir(c.env)
        self.children.clear()
        if stuck:
            raise RuntimeError("the deployment did not stop cleanly: not reaped even after "
                               f"SIGKILL: {', '.join(stuck)}")
