"""Workers start with the model's own length, as vLLM does: the shared test workers, started
without --max-model-len, report their checkpoint's 2,048 positions (the 32,768-position model
is served in tests/launch/test_hub_model.py); and when one sequence of that length does not fit
the KV cache, `splitserve worker` says so and names the flags that fix it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from splitserve.worker.launch import free_port
from tests.support.cli import splitserve_argv
from tests.support.workers import TEST_SPECS, Worker, auth_headers, make_checkpoint


def test_workers_report_the_models_own_length(llama_pair: tuple[Worker, Worker]) -> None:
    assert TEST_SPECS["llama"].max_position_embeddings == 2048
    for w in llama_pair:
        assert w.cfg.max_model_len is None  # no --max-model-len given
        model = httpx.get(f"{w.url}/v1/models", headers=auth_headers(), timeout=10).json()
        assert model["data"][0]["max_model_len"] == 2048


def test_a_kv_cache_too_small_for_the_models_length_names_the_flags(checkpoint_root: Path
                                                                     ) -> None:
    ckpt = make_checkpoint(checkpoint_root, "llama-128k-wide-kv")  # 2 GiB for one sequence
    done = subprocess.run(
        splitserve_argv("worker", "--model", str(ckpt), "--port", str(free_port()),
                        "--kv-cache-gib", "1", "--cpus", "0"),
        capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("splitserve worker: the KV cache cannot hold one sequence of 131072 "
                           "tokens"), done.stdout[-3000:] + done.stderr[-3000:]
    assert "--max-model-len" in said and "--kv-cache-gib" in said
    assert "VLLM_CPU_KVCACHE_SPACE" in said and "needs 2.0 GiB" in said
    assert "--kv-cache-gib 3 or more" in said
    fits = int(said.split("--max-model-len ")[1].split()[0])
    assert 32768 < fits < 65536  # what 1 GiB holds at 16 KiB a token, as vLLM estimates it
