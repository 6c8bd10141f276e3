"""Shared fixtures for the simulator tests: a constructed profile with round numbers."""

from __future__ import annotations

import pytest

from splitserve.sim.costmodel import DecodeCost, PrefillCost, TransferLink
from splitserve.sim.model import Engine, ModelShape, Profile

PREFILL = PrefillCost(0.02, 0.001, 1e-7)
DECODE = DecodeCost(0.005, 2e-6, 1e-3)
LINK = TransferLink(1e8, 0.002)


def make_profile(prefill: PrefillCost = PREFILL, decode: DecodeCost = DECODE,
                 link: TransferLink = LINK, budget: int = 2048,
                 capacity: int = 1_000_000) -> Profile:
    return Profile(kind="analytic", engine=Engine("vllm", "0.32.0"),
                   model=ModelShape("test", layers=8, kv_heads=2, head_dim=64, dtype_bytes=4),
                   hardware={"name": "constructed"}, prefill=prefill, decode=decode,
                   token_budget=budget, kv_capacity_tokens=capacity,
                   transfer={"tcp": link})


@pytest.fixture
def profile() -> Profile:
    return make_profile()
