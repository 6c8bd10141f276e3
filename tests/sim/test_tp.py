"""Tensor parallelism in analytic profiles, and a D pool whose workers differ from P's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from splitserve.cli import main
from splitserve.sim.analytic import PRESETS, ModelConfig, allreduce_s, analytic_profile, gpus_of
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import load_profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload

# Llama-3.1-70B's public shape
L70 = ModelConfig("llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                  intermediate=28672, vocab=128256)
H100 = PRESETS["h100-sxm"]


def test_tp_adds_up_the_ranks_and_pays_two_all_reduces_a_layer() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        analytic_profile(L70, H100, tp=1)
    p2, p4, p8 = (analytic_profile(L70, H100, tp=tp) for tp in (2, 4, 8))
    assert [gpus_of(p) for p in (p2, p4, p8)] == [2, 4, 8]
    step_s, token_s = allreduce_s(L70, H100, 4)
    ring = 2 * 3 / 4 * 8192 * 2 / H100.allreduce_bw  # one all-reduce of one token at tp=4
    assert token_s == pytest.approx(2 * 80 * ring)
    assert step_s == pytest.approx(2 * 80 * H100.allreduce_latency_s)
    compute_4 = p4.prefill.b - token_s
    assert compute_4 == pytest.approx(2 * L70.layer_params / (H100.flops * H100.mfu * 4))
    # twice the GPUs: less than half the time per prompt token (compute halves, comm grows)
    assert p8.prefill.b < p4.prefill.b and p8.prefill.b > p4.prefill.b / 2
    # KV memory: the weights are paid once over all ranks, so it more than doubles
    assert p8.kv_capacity_tokens > 2 * p4.kv_capacity_tokens
    assert p4.transfer["rdma"].bandwidth_Bps == 4 * H100.link_bw  # a NIC per GPU


def test_kv_heads_are_replicated_beyond_their_count() -> None:
    two_kv = replace(L70, kv_heads=2)
    p2 = analytic_profile(two_kv, H100, tp=2)
    p8 = analytic_profile(two_kv, H100, tp=8)
    # at tp=8 each rank holds one of the 2 KV heads: 4 copies of each
    assert p8.decode.b == pytest.approx(p2.decode.b)  # 4x the KV bytes over 4x the ranks
    free8 = H100.memory_bytes * H100.mem_util * 8 - two_kv.weight_bytes
    assert p8.kv_capacity_tokens == int(free8 // (4 * two_kv.shape().kv_bytes_per_token))


def test_tp_must_split_the_heads_within_a_node() -> None:
    with pytest.raises(ValueError, match="do not split"):
        analytic_profile(replace(L70, heads=60), H100, tp=8)
    with pytest.raises(ValueError, match="1..8"):
        analytic_profile(L70, H100, tp=16)


def test_profile_cli_takes_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, '
                   '"num_key_value_heads": 8, "intermediate_size": 28672, '
                   '"vocab_size": 128256}')
    out = tmp_path / "p.json"
    assert main(["profile", "--analytic", "--model-config", str(cfg), "--tp", "4",
                 "--out", str(out)]) == 0
    assert load_profile(out).hardware["tp"] == 4
    assert main(["profile", "--analytic", "--model-config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve profile: ") and "does not fit" in err


def test_a_d_pool_of_other_workers_decodes_at_its_own_pace() -> None:
    p8, p4 = analytic_profile(L70, H100, tp=8), analytic_profile(L70, H100, tp=4)
    n = 20
    wl = SimWorkload(np.arange(n) * 1.0, np.full(n, 2000), np.full(n, 64))
    cfg = SimConfig(n_prefill=1, n_decode=1, transport="rdma")
    same = summarize(simulate(p8, cfg, wl))
    slower_d = summarize(simulate(p8, cfg, wl, decode_profile=p4))
    assert slower_d["median_ttft_ms"] == pytest.approx(same["median_ttft_ms"])  # P's alone
    assert slower_d["median_tpot_ms"] > same["median_tpot_ms"]
    other_model = analytic_profile(replace(L70, kv_heads=16), H100, tp=4)
    with pytest.raises(ValueError, match="one model"):
        simulate(p8, cfg, wl, decode_profile=other_model)
