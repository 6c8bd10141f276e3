"""Router test fixtures: a plain colocated reference worker, a second P/D pair, and routers as
real processes, all gone after this package.

Routers run as `splitserve router` subprocesses on loopback over the session's llama P/D pair
(tests/conftest.py) and one plain vLLM worker on the same checkpoint (the colocated reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cores
from tests.support.routers import Router, start_router
from tests.support.workers import Worker, launch, launch_together, stop_all


@pytest.fixture(scope="package")
def colocated_worker(llama_ckpt: Path) -> Iterator[Worker]:
    """A plain vLLM worker (no connector) on the P/D pair's checkpoint: the reference."""
    w = launch(llama_ckpt, "router-colocated", None, cpus=cores.BOTH)
    yield w
    w.stop()


@pytest.fixture(scope="package")
def second_pair(llama_ckpt: Path) -> Iterator[tuple[Worker, Worker]]:
    """A second P and D beside the session's pair, started side by side: test_2p2d's 2P+2D,
    test_cache_e2e's second P. P's answers carry the engine's count of cached prompt tokens,
    for a router to compare. test_2p2d's last tests kill this D: no later test may use it."""
    p2, d2 = launch_together(
        llama_ckpt, ("llama-p2", "prefill", {"cpus": cores.spare_cores("prefill", 0),
                                             "extra_args": ("--enable-prompt-tokens-details",)}),
        ("llama-d2", "decode", {"cpus": cores.spare_cores("decode", 1)}))
    yield p2, d2
    stop_all(p2, d2)  # stopping the killed D's group only reaps it


@pytest.fixture(scope="package")
def second_p(second_pair: tuple[Worker, Worker]) -> Worker:
    return second_pair[0]


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
