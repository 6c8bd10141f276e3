"""Shared fixtures (test checkpoints, the llama P/D pair used across test packages) and the
suite's hooks (tests/README.md says more):

- Integration tests are marked at collection (`tests.support.integration.is_integration`): a
  test reaching a helper that starts real processes gets `integration`; `make test-fast` runs
  the rest (`-m "not integration"`), which may start no server (`no_server_processes`).
- After an integration test's body passes, every worker still running must drain to zero
  (`check_drained`): a leak fails the test that left it.
- The Ray backend's package runs first: its cluster starts and scales up to five vLLM workers on
  this 2-core, 24 GiB machine, and no session-scoped worker of another package (about 3 GB
  resident each) may be alive beside them. Its package-scoped cluster is torn down before the
  next package starts.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from splitserve.common.privatedir import RUNTIME_DIR_ENV
from tests.support import cores
from tests.support.integration import check_drained, is_integration, no_server_processes
from tests.support.workers import Worker, launch_together, make_checkpoint, stop_all

RAY_TESTS = Path(__file__).parent / "raybackend"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks given here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_integration(item):
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: not item.path.is_relative_to(RAY_TESTS))


def _guarded(item: pytest.Item) -> Generator[None, object, object]:
    """A phase of `item`: an unmarked test may start no server in it."""
    if item.get_closest_marker("integration") is not None:
        return (yield)
    with no_server_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    result = yield from _guarded(item)
    if item.get_closest_marker("integration") is not None:
        check_drained(item)  # only once the body passed: its own failure comes first
    return result


@pytest.fixture(scope="session", autouse=True)
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where `worker_command` makes each worker's private directory for its Unix
    sockets (`worker.kvrelay.private_dir`): this session's temporary directory, which pytest
    removes, since many tests build a worker's command without starting it."""
    path = tmp_path_factory.getbasetemp() / "run"
    path.mkdir(exist_ok=True)
    saved = os.environ.get(RUNTIME_DIR_ENV)
    os.environ[RUNTIME_DIR_ENV] = str(path)
    yield path
    if saved is None:
        os.environ.pop(RUNTIME_DIR_ENV, None)
    else:
        os.environ[RUNTIME_DIR_ENV] = saved


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def llama_ckpt(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, "llama")


@pytest.fixture(scope="session")
def llama_pair(llama_ckpt: Path) -> Iterator[tuple[Worker, Worker]]:
    """P (chunked-prefill budget 256, test faults on) and D (3 s load timeout), on loopback."""
    p, d = launch_together(
        llama_ckpt, ("llama-p", "prefill", {"env": {"SPLITSERVE_FAULTS": "1"},
                                            "max_num_batched_tokens": 256, "cpus": cores.PREFILL}),
        ("llama-d", "decode", {"load_timeout_s": 3.0, "cpus": cores.DECODE}))
    yield p, d
    stop_all(p, d)
