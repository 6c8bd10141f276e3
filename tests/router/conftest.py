"""Router test fixtures: a plain colocated reference worker and routers as real processes.

Routers run as `splitserve router` subprocesses on loopback over the session's llama P/D pair
(tests/conftest.py) and one plain vLLM worker on the same checkpoint (the colocated reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cores
from tests.support.routers import Router, start_router
from tests.support.workers import Worker, launch


@pytest.fixture(scope="package")
def colocated_worker(llama_ckpt: Path) -> Iterator[Worker]:
    """A plain vLLM worker (no connector) on the P/D pair's checkpoint: the reference."""
    w = launch(llama_ckpt, "router-colocated", None, cpus=cores.BOTH)
    yield w
    w.stop()


@pytest.fixture(scope="package")
def router_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="package")
def router_pd(llama_pair: tuple[Worker, Worker], router_logs: Path) -> Iterator[Router]:
    """1P1D over tcp (what the workers advertise)."""
    p, d = llama_pair
    r = start_router(router_logs, "--prefill", p.url, "--decode", d.url)
    yield r
    r.stop()


@pytest.fixture(scope="package")
def router_pd_shm(llama_pair: tuple[Worker, Worker], router_logs: Path) -> Iterator[Router]:
    """1P1D with every transfer over shared memory."""
    p, d = llama_pair
    r = start_router(router_logs, "--prefill", p.url, "--decode", d.url, "--kv-transport", "shm")
    yield r
    r.stop()


@pytest.fixture(scope="package")
def router_colocated(colocated_worker: Worker, router_logs: Path) -> Iterator[Router]:
    r = start_router(router_logs, "--colocated", colocated_worker.url)
    yield r
    r.stop()
