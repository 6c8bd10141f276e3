"""`profile_worker` against a real plain vLLM worker on a tiny random checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from splitserve.config import WorkerConfig
from splitserve.demo_model import ModelSpec, build_checkpoint
from splitserve.sim.calibration.drift import CanaryPlan, Drift, run_canary
from splitserve.sim.model import load_profile, save_profile
from splitserve.sim.profile import ProfilePlan, profile_worker
from splitserve.worker.launch import free_port, installed_vllm_version, start_worker, wait_healthy

TINY = ModelSpec(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32)


@pytest.mark.integration
def test_profile_a_real_worker(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "tiny", TINY)
    cfg = WorkerConfig(model=str(model), port=free_port(), max_model_len=1024)
    proc = start_worker(cfg, None, log_path=str(tmp_path / "worker.log"))
    try:
        wait_healthy(cfg.url, proc, timeout_s=240)
        plan = ProfilePlan(prefill_lens=(16, 128, 512, 900), prefill_repeats=1,
                           decode_batches=(1, 3), decode_prompt_lens=(16, 200),
                           decode_tokens=48, token_budget=256)
        steps: list[tuple[int, int]] = []
        prof = profile_worker(cfg.url, plan, probe_tcp=True, probe_nixl=True,
                              progress=lambda done, total: steps.append((done, total)))
        assert steps and steps[-1][0] == steps[-1][1] == len(steps)  # every step, in order
        canary = run_canary(cfg.url, CanaryPlan(prompt=200, tokens=12, requests=2))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    assert prof.kind == "measured"
    assert prof.engine.version == installed_vllm_version()
    assert (prof.model.layers, prof.model.kv_heads, prof.model.head_dim,
            prof.model.dtype_bytes) == (2, 2, 32, 4)
    assert [n for n, _ in prof.fit["prefill_points"]] == [16, 128, 512, 900]
    assert [(b, c > 0) for b, c, _ in prof.fit["decode_points"]] == [(1, True), (3, True)] * 2
    assert all(t > 0 for _, t in prof.fit["prefill_points"])
    assert prof.kv_capacity_tokens > 1000  # read from the worker's /metrics
    assert prof.transfer["tcp"].source.startswith("loopback")
    # NIXL READs of the worker's KV block per layer: 128 tokens × 2 kv heads × 32 × 4 B
    assert prof.transfer["nixl"].bandwidth_Bps > 0
    assert "nixl probe" in prof.transfer["nixl"].source
    assert "32768 B descriptors" in prof.transfer["nixl"].source
    # the decode windows' gaps less their local pace: the jitter bins and their samples
    assert sum(w for _, w in prof.gap_jitter_s) == 1000 and len(prof.fit["jitter_ms"]) >= 50
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json", engine_version=installed_vllm_version()) == prof
    # the drift canary reads the same worker: a prefill of 200 tokens, then decode steps
    assert 0 < canary.gap_s < 1 and 0 < canary.ttft_s < 5
    assert canary.drift(canary) == Drift(1.0, 1.0, 1.0) and canary.stretch is None
