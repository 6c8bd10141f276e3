"""`benchmarks/gpu_kv.py`, the device check that runs once on a borrowed GPU, kept runnable here:
its round trip through the copier is bit-exact for every layout on a small shape (CPU, inline
copier), and its overlap measure runs. Its timings are not asserted."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from splitserve.connector.devcopy import InlineCopies
from splitserve.connector.layout.strided import LAYOUTS
from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def gpu_kv() -> ModuleType:
    return load_script("gpu_kv")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_is_bit_exact_for_every_layout(gpu_kv: ModuleType, name: str) -> None:
    shape = gpu_kv.Shape(3, 2, 8, 4, torch.bfloat16)
    row = gpu_kv.bench_layout(name, shape, 37, InlineCopies(), torch.device("cpu"), reps=1,
                              seed=5)  # 37 tokens: nine whole blocks and a partial one
    assert row["bit_exact"] is True and row["staging_matches_cpu"] is True
    assert row["bytes"] == 37 * shape.bytes_per_token_layer * shape.layers


def test_overlap_measure_runs(gpu_kv: ModuleType) -> None:
    shape = gpu_kv.Shape(2, 2, 8, 4, torch.bfloat16)
    out = gpu_kv.bench_overlap(shape, 20, InlineCopies(), torch.device("cpu"), reps=1,
                               matmul_n=16, per_layer=1)
    assert out["matmul_s"] > 0 and out["saves_s"] > 0 and out["matmul_with_saves_s"] > 0
    assert 0.0 <= out["overlap_fraction"] <= 1.0
