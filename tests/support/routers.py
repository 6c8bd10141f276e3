"""Routers as real `splitserve router` processes on loopback, for the router tests."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from splitserve.common.procs import stop_group
from splitserve.config import bearer_headers
from splitserve.worker.launch import free_port, wait_healthy
from tests.support.cli import splitserve_argv
from tests.support.integration import starts_processes
from tests.support.workers import TOKEN


@dataclass
class Router:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        stop_group(self.proc, 15.0)

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]

    def drain(self, url: str, draining: bool = True) -> None:
        """Stop (or resume) sending the worker at `url` new requests (the admin endpoint)."""
        r = httpx.post(f"{self.url}/admin/workers/drain",
                       json={"url": url, "undrain": not draining},
                       headers=bearer_headers(TOKEN), timeout=5)
        r.raise_for_status()

    def route_only(self, *urls: str) -> None:
        """Only the workers at `urls` take new requests; every other one is drained."""
        for w in self.workers():
            self.drain(w["url"], w["url"] not in urls)

    def wait_kv_endpoints(self, timeout_s: float = 30.0) -> None:
        """Until every worker is healthy and the router holds its KV endpoint (learnt by its
        health checks), so that the next request can be split."""
        deadline = time.monotonic() + timeout_s
        while not all(w["healthy"] and w["kv_endpoint"] for w in self.workers()):
            assert time.monotonic() < deadline, self.workers()
            time.sleep(0.2)

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Until the router has no leg open on any worker."""
        deadline = time.monotonic() + timeout_s
        while any(w["inflight"] for w in self.workers()):
            assert time.monotonic() < deadline, self.workers()
            time.sleep(0.1)


@starts_processes
def start_router(log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> Router:
    port = port or free_port()
    log = log_dir / f"router-{port}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            splitserve_argv("router", "--port", str(port), "--health-interval", "0.5", *args),
            env=os.environ | {"SPLITSERVE_TOKEN": TOKEN} | (env or {}), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_healthy(router.url, proc, timeout_s=120)
    except BaseException:
        router.stop()
        raise
    return router


