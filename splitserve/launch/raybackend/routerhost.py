"""The router on Ray: an actor that runs the same `splitserve router` process as the local
launcher and keeps its registry in step with the directory.

Invariants:
- The router process lives in its own process group under `guard` (it dies with this actor).
- Every second the host reads the directory's live workers and the router's `/workers`:
  a worker Ray placed and the router lacks is added (`POST /admin/workers`); one that is
  draining or gone from Ray is removed (`POST /admin/workers/remove`, which takes it out of
  rotation at once and waits for its open legs), then, once the router let it go, reported
  `released` to the directory.
  The router never holds a static URL list beyond the workers it started with.
- The router's per-worker view (open legs, queued prompt tokens) goes to the directory on each
  round: it is P's autoscaling signal, and the directory's proof that a router is alive.
- With several routers (`routers: N`), host i runs router i on `port + i`; each round it sets
  its router's peers (`PUT /admin/peers`) to the other routers the directory knows alive.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from splitserve.common.guard import GRACE_ENV, guarded
from splitserve.common.procs import stop_group
from splitserve.common.vocab import Pool, values
from splitserve.config import TOKEN_ENV, bearer_headers
from splitserve.launch.config import DeploymentConfig
from splitserve.launch.local import EXIT_S, router_argv
from splitserve.launch.raybackend.replica import log_path, node_model
from splitserve.router.cli import API_KEY_ENV
from splitserve.worker.launch import wait_healthy

log = logging.getLogger("splitserve.ray")


def plan_sync(live: list[dict[str, Any]], routed: list[dict[str, Any]]
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(to add, to remove): live non-draining workers the router lacks or knows without their
    node (adding one of those only sets its node), and router workers that are draining or no
    longer live. A live worker's `kind` is its router pool (`Pool`)."""
    keep = {(Pool(w["kind"]), w["url"]) for w in live if not w["draining"]}
    have = {(w["role"], w["url"]) for w in routed if w.get("node")}
    add = [w for w in live if not w["draining"]
           and (Pool(w["kind"]), w["url"]) not in have]
    remove = [w for w in routed if (w["role"], w["url"]) not in keep]
    return add, remove


class RouterHost:
    """Made a Ray actor by the driver; `start` returns the router's URL."""

    def __init__(self, cfg: DeploymentConfig, directory: str, index: int = 0) -> None:
        import ray

        self.cfg = cfg
        self.index = index
        self.port = cfg.router_ports[index]
        self.peers: list[str] | None = None  # as last set on the router
        self.directory = ray.get_actor(directory, namespace=cfg.ray.namespace)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()
        self.removing: set[str] = set()
        self.pool = ThreadPoolExecutor(8)
        self.host = cfg.host
        node_ip = ray.util.get_node_ip_address()
        self.public_host = node_ip if cfg.host in ("0.0.0.0", "::") else cfg.host
        self.url = f"http://{self.public_host}:{self.port}"
        self.token: str | None = None

    def start(self, timeout_s: float) -> str:
        import ray

        token, api_key = ray.get(self.directory.secrets.remote())
        self.token = token
        self.headers = bearer_headers(token)
        deadline = time.monotonic() + timeout_s
        need = ("prefill", "decode") if self.cfg.prefill else ()
        while True:
            live = [w for w in ray.get(self.directory.snapshot.remote()) if not w["draining"]]
            kinds = {w["kind"] for w in live}
            if all(k in kinds for k in need) and (need or "colocated" in kinds):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy workers after {timeout_s:.0f} s")
            time.sleep(0.5)
        env = dict(os.environ)
        env[TOKEN_ENV] = token or ""
        if api_key:
            env[API_KEY_ENV] = api_key
        # the router drains for stop_timeout_s (`router_argv`), then closes and exits
        env[GRACE_ENV] = str(self.cfg.stop_timeout_s + EXIT_S)
        self.log = log_path(self.cfg, f"{self.cfg.ray.name}-router"
                            + (str(self.index) if self.index else ""))
        urls = {kind: [w["url"] for w in live if w["kind"] == kind]
                for kind in values(Pool)}
        argv = router_argv(self.cfg, node_model(self.cfg)[0], self.host, urls,
                           "--health-interval", "0.5", port=self.port)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                guarded(argv), env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, self.proc, timeout_s)
        self.client = httpx.Client(headers=self.headers, timeout=5.0)
        threading.Thread(target=self._loop, name="router-sync", daemon=True).start()
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _loop(self) -> None:
        while not self.stopping.wait(0.5):
            try:
                self.sync_once()
            except Exception:  # the loop must outlive any one bad answer
                log.exception("router sync round failed")

    def sync_once(self) -> None:
        import ray

        live = ray.get(self.directory.snapshot.remote())
        routed = self.client.get(f"{self.url}/workers").json()["workers"]
        ray.get(self.directory.router_report.remote(self.url, {
            w["url"]: {"inflight": float(w.get("inflight", 0)),
                       "inflight_prefill_tokens": float(w.get("inflight_prefill_tokens", 0))}
            for w in routed}))
        self._set_peers(ray.get(self.directory.routers.remote()))
        add, remove = plan_sync(live, routed)
        for w in add:
            r = self.client.post(f"{self.url}/admin/workers",
                                 json={"url": w["url"], "role": Pool(w["kind"]).value,
                                       "node": w["node_id"]})
            if r.status_code not in (200, 201, 400):  # 400: added by a round still in flight
                log.warning("router refused worker %s: %s", w["url"], r.text)
        by_url = {w["url"]: w for w in live}
        for w in remove:
            key = f"{w['role']} {w['url']}"
            if key not in self.removing:
                self.removing.add(key)
                self.pool.submit(self._remove, w, by_url.get(w["url"]), key)
        for w in live:  # a draining worker the router never had (or let go already)
            if w["draining"] and not any(r["url"] == w["url"] for r in routed):
                self.directory.released.remote(w["replica"], self.url)

    def _set_peers(self, routers: list[str]) -> None:
        """The router's peers := the other live routers, when that changed."""
        peers = sorted(u for u in routers if u != self.url)
        if peers != self.peers:
            r = self.client.put(f"{self.url}/admin/peers", json={"peers": peers})
            if r.status_code == 200:
                self.peers = peers
            else:
                log.warning("router refused its peers %s: %s", peers, r.text)

    def _remove(self, routed: dict[str, Any], entry: dict[str, Any] | None, key: str) -> None:
        """Remove a worker from the router; `released` only once the router let it go (200,
        or 404: it had no such worker). A 504 (legs still open after the drain timeout) or a
        router that did not answer leaves it held: a later round tries again, and the replica's
        own drain deadline bounds its stop."""
        try:
            r = self.client.post(f"{self.url}/admin/workers/remove",
                                 json={"url": routed["url"], "role": routed["role"]},
                                 timeout=self.cfg.ray.drain_timeout_s + 5)
            if r.status_code not in (200, 404):
                log.warning("router kept worker %s: %s", routed["url"], r.text)
            elif entry is not None:
                self.directory.released.remote(entry["replica"], self.url)
        except httpx.HTTPError as exc:
            log.warning("router did not answer the removal of %s: %r", routed["url"], exc)
        finally:
            self.removing.discard(key)

    def stop(self) -> None:
        """SIGTERM the router (it drains its in-flight requests), SIGKILL after the timeout."""
        self.stopping.set()
        if self.proc is None:
            return
        # the guard alone (it passes SIGTERM on): its sentinel SIGKILLs the group on a SIGTERM
        stop_group(self.proc, self.cfg.stop_timeout_s + EXIT_S, term="leader", sweep=True,
                   reap_s=0.0)
