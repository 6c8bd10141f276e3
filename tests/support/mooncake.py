"""The workers of the Mooncake tests (tests/mooncakeconnector/conftest.py starts them)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.support.workers import Worker

# P's KV lease: short, so blocks no D reads come back within CI time
MOONCAKE_LEASE_S = 12.0


@dataclass(frozen=True)
class MooncakeWorkers:
    """Two Ps (core 0) and two Ds (core 1) running vLLM's MooncakeConnector over tcp."""

    p1: Worker
    p2: Worker
    d1: Worker
    d2: Worker
