"""NIXL fixtures: one 1P1D of vLLM's NixlConnector (as `--connector nixl` starts it) shared by
every test of this package (and gone after it); P on core 0, D on core 1, float32, on loopback.

P's KV lease is short (`nixl_helpers.NIXL_LEASE_S`) so the tests that abandon a D leg see P's
blocks come back within CI time; D pulls within milliseconds, far inside it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from nixl_helpers import NIXL_LEASE_S  # noqa: E402
from workers import Worker, launch  # noqa: E402


@pytest.fixture(scope="package")
def nixl_pd(llama_ckpt: Path) -> Iterator[tuple[Worker, Worker]]:
    p = launch(llama_ckpt, "nixl-p", "prefill", connector="nixl", cpus=(0,),
               max_num_batched_tokens=256, lease_s=NIXL_LEASE_S)
    try:
        d = launch(llama_ckpt, "nixl-d", "decode", connector="nixl", cpus=(1,),
                   lease_s=NIXL_LEASE_S)
    except BaseException:
        p.stop()
        raise
    yield p, d
    p.stop()
    d.stop()
