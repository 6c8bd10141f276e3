"""Shared fixtures: test checkpoints and the llama P/D pair used across test packages.

The Ray backend's package runs first: its cluster starts and scales up to five vLLM workers on
this 2-core, 24 GiB machine, and no session-scoped worker of another package (about 3 GB
resident each) may be alive beside them. Its package-scoped cluster is torn down before the
next package starts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from workers import Worker, launch, make_checkpoint  # noqa: E402

RAY_TESTS = Path(__file__).parent / "raybackend"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.path.is_relative_to(RAY_TESTS))


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def llama_ckpt(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, "llama")


@pytest.fixture(scope="session")
def llama_pair(llama_ckpt: Path) -> Iterator[tuple[Worker, Worker]]:
    """P (chunked-prefill budget 256, test faults on) and D (3 s load timeout), on loopback."""
    p = launch(llama_ckpt, "llama-p", "prefill", env={"SPLITSERVE_FAULTS": "1"},
               max_num_batched_tokens=256, cpus=(0,))
    try:
        d = launch(llama_ckpt, "llama-d", "decode", load_timeout_s=3.0, cpus=(1,))
    except BaseException:
        p.stop()
        raise
    yield p, d
    p.stop()
    d.stop()
