"""The two legs driven by hand over HTTP: greedy output through P -> KV push -> D equals
Hugging Face transformers (float32), for a dense model (Llama) and two mixture-of-experts
families (Mixtral, Qwen2-MoE, each with its dense sibling's attention), both transports,
concurrent requests of mixed lengths, and a prompt longer than P's chunked-prefill budget; and
each model served whole by its P (colocated) equals transformers too. The third MoE family,
Qwen3-MoE, runs its 1P1D over both transports in `test_tp.py` (a P and a D of unequal TP)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cores
from tests.support.workers import (
    Worker,
    hf_greedy,
    launch_together,
    make_checkpoint,
    split_at_once,
    stop_all,
    transfer_record,
    two_legs,
    whole_answer,
)

# 1 token, short, exactly one block, across blocks, and 1,000 (> P's 256-token budget: chunked).
PROMPT_LENGTHS = (1, 7, 128, 300, 1000)
MAX_TOKENS = 12


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 31 + i * 17) % 1000 for i in range(length)]


@pytest.fixture(scope="module", params=["llama", "mixtral", "qwen2_moe"])
def pair(request: pytest.FixtureRequest, checkpoint_root: Path
         ) -> Iterator[tuple[str, Path, Worker, Worker]]:
    arch = request.param
    if arch == "llama":  # the session-wide pair, shared with the failure tests
        p, d = request.getfixturevalue("llama_pair")
        yield arch, Path(p.cfg.model), p, d
        return
    ckpt = make_checkpoint(checkpoint_root, arch)
    p, d = launch_together(
        ckpt, (f"{arch}-p", "prefill", {"max_num_batched_tokens": 256, "cpus": cores.PREFILL}),
        (f"{arch}-d", "decode", {"load_timeout_s": 3.0, "cpus": cores.DECODE}))
    yield arch, ckpt, p, d
    stop_all(p, d)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_concurrent_mixed_lengths_match_transformers(pair: tuple[str, Path, Worker, Worker],
                                                     transport: str) -> None:
    arch, _, p, d = pair
    # fresh prompts per transport: a prompt D already has in its prefix cache loads nothing
    offset = 0 if transport == "tcp" else 50
    prompts = [prompt_of(n, seed + offset) for seed, n in enumerate(PROMPT_LENGTHS)]
    split = split_at_once(p, d, prompts, MAX_TOKENS, transport, arch)
    for prompt, _, rec in split:
        # the KV really came over the channel: every prompt token, loaded into D's blocks
        assert rec["status"] == "loaded" and rec["tokens"] == len(prompt), rec
    # P copied layers out of its blocks on its forward thread (those of the 1,000-token
    # prompt's second chunk at least: D had long answered BEGIN by then)
    sent = transfer_record(p, split[-1][1])["send"]
    assert sent["status"] == "complete" and sent["copy_forward_s"] > 0, sent


def test_the_p_worker_serving_whole_requests_matches_transformers(
        pair: tuple[str, Path, Worker, Worker]) -> None:
    """No kv_transfer_params: P runs the request itself, as a colocated worker does."""
    arch, ckpt, p, _ = pair
    for seed, n in enumerate((5, 300)):
        prompt = prompt_of(n, 70 + seed)
        assert whole_answer(p, prompt, MAX_TOKENS) == hf_greedy(ckpt, prompt, MAX_TOKENS), arch


def test_prefix_cache_hits_on_p_are_still_sent(pair: tuple[str, Path, Worker, Worker]) -> None:
    """A repeated prompt hits P's prefix cache (still sent in full) and D's (shrinks the copy)."""
    arch, ckpt, p, d = pair
    prompt = prompt_of(400, 99)
    expected = hf_greedy(ckpt, prompt, MAX_TOKENS)
    loaded = []
    for _ in range(2):
        tid = f"{arch}-cached-{uuid.uuid4().hex}"
        tokens, rp, _ = two_legs(p, d, prompt, MAX_TOKENS, tid)
        assert tokens == expected
        rec = transfer_record(d, tid)["recv"]
        assert rec["tokens"] == 400 and rec["status"] == "loaded"
        loaded.append(rec["loaded_tokens"])
    assert rp.json()["usage"]["prompt_tokens"] == 400
    # the first load copies every token; the second finds whole blocks in D's own prefix cache
    assert loaded[0] == 400 and 0 < loaded[1] < 400
