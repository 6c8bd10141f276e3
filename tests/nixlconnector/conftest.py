"""NIXL fixtures: one 1P1D of vLLM's NixlConnector (as `--connector nixl` starts it) shared by
every test of this package (and gone after it); P on core 0, D on core 1, float32, on loopback.
Its model is the Qwen3-MoE test checkpoint (`nixl_ckpt`: mixture of experts, q/k norms, one KV
head), so every NIXL test runs an MoE model; dense Llama over NIXL runs in the speculative and
Ray tests.

P's KV lease is short (`nixl_helpers.NIXL_LEASE_S`) so the tests that abandon a D leg see P's
blocks come back within CI time; D pulls within milliseconds, far inside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cores
from tests.support.nixl_helpers import NIXL_LEASE_S
from tests.support.workers import Worker, launch_together, make_checkpoint, stop_all


@pytest.fixture(scope="package")
def nixl_ckpt(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, "qwen3_moe")


@pytest.fixture(scope="package")
def nixl_pd(nixl_ckpt: Path) -> Iterator[tuple[Worker, Worker]]:
    common = {"connector": "nixl", "lease_s": NIXL_LEASE_S}
    p, d = launch_together(
        nixl_ckpt, ("nixl-p", "prefill", common | {"cpus": cores.PREFILL,
                                                    "max_num_batched_tokens": 256}),
        ("nixl-d", "decode", common | {"cpus": cores.DECODE}))
    yield p, d
    stop_all(p, d)
