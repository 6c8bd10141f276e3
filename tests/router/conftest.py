"""Router test fixtures: routers as real processes over the session's workers.

Routers run as `splitserve router` subprocesses on loopback over the session's llama P/D pair
(tests/conftest.py) and the session's plain vLLM worker on the same checkpoint
(`colocated_worker`, tests/conftest.py: the colocated reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.routers import Router, start_router
from tests.support.workers import Worker


@pytest.fixture(scope="session")
def router_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="session")
def router_pd(llama_pair: tuple[Worker, Worker], router_logs: Path) -> Iterator[Router]:
    """1P1D over tcp (what the workers advertise)."""
    p, d = llama_pair
    r = start_router(router_logs, "--prefill", p.url, "--decode", d.url)
    yield r
    r.stop()


@pytest.fixture(scope="session")
def router_pd_shm(llama_pair: tuple[Worker, Worker], router_logs: Path) -> Iterator[Router]:
    """1P1D with every transfer over shared memory."""
    p, d = llama_pair
    r = start_router(router_logs, "--prefill", p.url, "--decode", d.url, "--kv-transport", "shm")
    yield r
    r.stop()


@pytest.fixture(scope="session")
def router_colocated(colocated_worker: Worker, router_logs: Path) -> Iterator[Router]:
    r = start_router(router_logs, "--colocated", colocated_worker.url)
    yield r
    r.stop()
