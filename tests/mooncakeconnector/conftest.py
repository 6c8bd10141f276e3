"""Mooncake fixtures: vLLM's MooncakeConnector as `--connector mooncake` starts it (protocol tcp,
Mooncake's transfer engine built without CUDA, from the `mooncake` extra), shared by this
package's tests and gone after it: two Ps on core 0 and two Ds on core 1, float32 Llama, on
loopback. P's KV lease is short (`MOONCAKE_LEASE_S`) so blocks no D reads come back within CI
time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mooncake import MOONCAKE_LEASE_S, MooncakeWorkers
from tests.support.workers import launch_together, stop_all


@pytest.fixture(scope="package")
def mooncake(llama_ckpt: Path) -> Iterator[MooncakeWorkers]:
    common = {"connector": "mooncake", "lease_s": MOONCAKE_LEASE_S, "mooncake_protocol": "tcp"}
    p1, p2, d1, d2 = launch_together(
        llama_ckpt,
        ("mooncake-p1", "prefill", common | {"cpus": (0,)}),
        ("mooncake-p2", "prefill", common | {"cpus": (0,)}),
        ("mooncake-d1", "decode", common | {"cpus": (1,)}),
        ("mooncake-d2", "decode", common | {"cpus": (1,)}))
    workers = MooncakeWorkers(p1, p2, d1, d2)
    yield workers
    stop_all(p1, p2, d1, d2)
