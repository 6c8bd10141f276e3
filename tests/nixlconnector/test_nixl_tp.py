"""vLLM's NixlConnector between workers of unequal tensor parallelism, through the router: a
worker of 2 ranks beside one of 1, both of role both, so one router splits P TP=2 -> D TP=1 and
another P TP=1 -> D TP=2. The model is Llama with 4 KV heads (2 a rank at TP=2), so NIXL maps
heads in both directions (a TP=1 D reads half its heads from each P rank; each D rank reads its
half from the TP=1 P).

Each worker keeps its own core, its ranks sharing it, as `splitserve serve` places them: a rank
spinning on the other worker's core starves that worker's handshake listener past vLLM's 5 s
timeout.

Greedy float32 output equals transformers on concurrent prompts, D loads every prompt token
(computes none), and both workers' KV is free afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import cores
from tests.support.nixl_helpers import NIXL_LEASE_S, tokens_by_source, wait_kv_free
from tests.support.routers import start_router
from tests.support.workers import Worker, hf_greedy, launch_together, make_checkpoint, stop_all

MAX_TOKENS = 8
LENGTHS = (100, 300)  # a partial block; more than the 256-token prefill budget (chunked)


def prompt_of(length: int, seed: int) -> list[int]:
    return [5 + (seed * 31 + i * 17) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def nixl_tp_pair(checkpoint_root: Path) -> Iterator[tuple[Worker, Worker]]:
    """(the TP=2 worker on core DECODE, the TP=1 worker on core PREFILL), role both."""
    ckpt = make_checkpoint(checkpoint_root, "llama-kv4")
    common = {"connector": "nixl", "lease_s": NIXL_LEASE_S, "max_num_batched_tokens": 256}
    two, one = launch_together(
        ckpt, ("nixl-tp2", "both", common | {"tensor_parallel_size": 2, "cpus": cores.DECODE}),
        ("nixl-tp1", "both", common | {"cpus": cores.PREFILL}))
    yield two, one
    stop_all(two, one)


@pytest.mark.parametrize("direction", ["p2-d1", "p1-d2"])
def test_unequal_tp_over_nixl_matches_transformers(nixl_tp_pair: tuple[Worker, Worker],
                                                   direction: str, tmp_path: Path) -> None:
    two, one = nixl_tp_pair
    # vLLM-CPU bound both ranks of the TP=2 worker to its one core
    bind = "|".join(map(str, cores.DECODE * 2))
    assert f"VLLM_CPU_OMP_THREADS_BIND='{bind}'" in two.log.read_text(errors="replace")
    p, d = (two, one) if direction == "p2-d1" else (one, two)
    model = Path(p.cfg.model)
    seed = 0 if direction == "p2-d1" else 10
    prompts = [prompt_of(n, seed + i) for i, n in enumerate(LENGTHS)]
    router = start_router(tmp_path, "--prefill", p.url, "--decode", d.url)
    try:
        router.wait_kv_endpoints()
        before = tokens_by_source(d)

        def run(prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
            r = httpx.post(f"{router.url}/v1/completions", timeout=180, json={
                "model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return (r.json()["choices"][0]["token_ids"],
                    json.loads(r.headers["x-splitserve-timings"]))

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(run, prompts))
        for prompt, (tokens, timings) in zip(prompts, got, strict=True):
            assert tokens == hf_greedy(model, prompt, MAX_TOKENS), (direction, len(prompt))
            assert timings["mode"] == "split" and timings["retries"] == 0, timings
        after = tokens_by_source(d)
        # D read every prompt token over NIXL (the handshake held) and computed none
        loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        assert (loaded, computed) == (sum(map(len, prompts)), 0), direction
        wait_kv_free(p, d, timeout_s=30)
    finally:
        router.stop()
