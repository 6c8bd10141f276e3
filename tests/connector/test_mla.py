"""DeepSeek-V2's latent (MLA) cache through splitserve's connector, on vLLM-CPU's MLA backend:
P pushes each layer's 576-wide latent rows (one copy a token, no K and V) and greedy output
equals transformers (float32) over tcp and shm, concurrent mixed lengths, through the router,
and served whole by P (colocated).

vLLM-CPU 0.32's rotary kernel mis-rotates DeepSeek's 3-D query/key views, so a worker of a
latent-attention model runs vLLM's native rope (`worker.launch.latent_rope_args`); without
it, output depends on the batch and differs from transformers (docs/guides/tp-moe.md)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import cores
from tests.support.routers import start_router
from tests.support.workers import (
    Worker,
    auth_headers,
    hf_greedy,
    launch_together,
    make_checkpoint,
    model_name,
    split_at_once,
    stop_all,
    wait_drained,
    whole_answer,
)

LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the one width vLLM-CPU's MLA kernel takes
LAYERS = 2
MAX_TOKENS = 10
# 1 token, inside one 16-token block, exactly one block, across blocks, long
PROMPT_LENGTHS = (1, 7, 16, 300, 1000)


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 37 + i * 17) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def mla_workers(checkpoint_root: Path) -> Iterator[tuple[Worker, Worker, Worker]]:
    """P and D of the DeepSeek-V2 checkpoint (the MLA backend turns chunked prefill and
    prefix caching off, so P takes no token budget), and a second P of TP 2, started side by
    side."""
    ckpt = make_checkpoint(checkpoint_root, "deepseek_v2")
    p, d, p_tp2 = launch_together(
        ckpt, ("mla-p", "prefill", {"cpus": cores.PREFILL}),
        ("mla-d", "decode", {"load_timeout_s": 30.0, "cpus": cores.DECODE}),
        ("mla-p-tp2", "prefill", {"tensor_parallel_size": 2, "cpus": cores.BOTH}))
    yield p, d, p_tp2
    stop_all(p, d, p_tp2)


@pytest.fixture(scope="module")
def mla_pair(mla_workers: tuple[Worker, Worker, Worker]) -> tuple[Worker, Worker]:
    return mla_workers[0], mla_workers[1]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_latent_moves_once_and_matches_transformers(mla_pair: tuple[Worker, Worker],
                                                        transport: str) -> None:
    p, d = mla_pair
    offset = 0 if transport == "tcp" else 50
    prompts = [prompt_of(n, seed + offset) for seed, n in enumerate(PROMPT_LENGTHS)]
    for prompt, _, rec in split_at_once(p, d, prompts, MAX_TOKENS, transport, "mla"):
        assert rec["status"] == "loaded" and rec["loaded_tokens"] == len(prompt), rec
        # one latent row of 576 float32 a token and layer: no K and V pair
        assert rec["bytes"] == len(prompt) * LAYERS * LATENT * 4, rec


def test_through_the_router_and_colocated(mla_pair: tuple[Worker, Worker],
                                          tmp_path: Path) -> None:
    """The router splits the request (its KV estimate counts the latent once); P serving the
    same prompt whole (vLLM's colocated path) answers the same."""
    p, d = mla_pair
    prompt = prompt_of(200, 7)
    want = hf_greedy(Path(p.cfg.model), prompt, MAX_TOKENS)
    router = start_router(tmp_path, "--prefill", p.url, "--decode", d.url)
    try:
        r = httpx.post(f"{router.url}/v1/completions", headers=auth_headers(), timeout=120,
                       json={"model": model_name(p), "prompt": prompt,
                             "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True})
        assert r.status_code == 200, r.text
        timings = json.loads(r.headers["x-splitserve-timings"])
        assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        router.stop()
    assert whole_answer(p, prompt, MAX_TOKENS) == want


def test_a_prefill_of_two_ranks_sends_the_latent_once(
        mla_workers: tuple[Worker, Worker, Worker]) -> None:
    """P of TP 2 -> D of TP 1: the latent is whole on each P rank, and only the first sends it
    (D's bytes are one copy); token-exact against transformers, and P of TP 2 serving whole
    answers the same."""
    _, d, p2 = mla_workers
    ckpt = Path(d.cfg.model)
    prompts = [prompt_of(n, 90 + i) for i, n in enumerate((7, 300))]
    for prompt, _, rec in split_at_once(p2, d, prompts, MAX_TOKENS, "tcp", "mla-tp2"):
        assert rec["status"] == "loaded", rec
        assert rec["bytes"] == len(prompt) * LAYERS * LATENT * 4, rec
    assert whole_answer(p2, prompts[1], MAX_TOKENS) == hf_greedy(ckpt, prompts[1], MAX_TOKENS)
    wait_drained(p2, d, timeout_s=60.0)
