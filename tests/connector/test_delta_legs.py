"""Moving only the KV that D lacks, through real workers (the session's llama pair: P with
256-token chunks, D with vLLM-CPU's 128-token blocks), the two legs driven by hand as the router
drives them: D's prefix cache is primed with a plain request for the prompt's first tokens, P is
told to skip the prefix the router would predict D holds (`skip_tokens`), and greedy output must
equal Hugging Face transformers token for token.

What "mid-block" means here: vLLM's prefix cache hits whole blocks, so D's own hit always ends at
a block end. What can fall mid-block or mid-chunk is everything around it: the skip against P's
256-token chunks (a chunk wholly skipped, or cut in two), the skip itself (any token offset P is
given, not a block multiple: the staged suffix then starts mid-block), D's hit beyond the skip
(the load starts inside a staged chunk) and the prompt's end (the last staged block partial)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.workers import (
    Worker,
    auth_headers,
    hf_greedy,
    model_name,
    transfer_record,
    two_legs,
)

MAX_TOKENS = 8
# KV bytes of one prompt token of the llama test model: 2 layers, K and V, 2 heads of 32 float32
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4


def prompt_of(length: int, seed: int) -> list[int]:
    """Tokens no other test sends (seeds from 700 on), so no cache hits but the ones primed."""
    return [3 + (seed * 37 + i * 13) % 1000 for i in range(length)]


def prime(d: Worker, prefix: list[int]) -> None:
    """Put `prefix`'s whole blocks in D's prefix cache: a plain request for it."""
    body = {"model": model_name(d), "prompt": prefix, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{d.url}/v1/completions", json=body, headers=auth_headers(), timeout=120)
    r.raise_for_status()


def final_record(worker: Worker, tid: str, side: str) -> dict[str, Any]:
    """The worker's record of `tid` once settled: P's once D acknowledged it (or it failed), D's
    once it can no longer change (loaded, failed, discarded, ...)."""
    pending = ("open",) if side == "send" else ("open", "complete")
    deadline = time.monotonic() + 10
    while True:
        rec: dict[str, Any] = transfer_record(worker, tid)[side]
        if rec["status"] not in pending or time.monotonic() > deadline:
            return rec
        time.sleep(0.05)


def delta(pair: tuple[Worker, Worker], ckpt: Path, n: int, primed: int, skip: int, seed: int
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request of `n` prompt tokens, D primed with its first `primed` tokens, P skipping
    `skip`; asserts the output is exact and returns (P's send record, D's recv record)."""
    p, d = pair
    prompt = prompt_of(n, seed)
    if primed:
        prime(d, prompt[:primed])
    tid = f"delta-{n}-{primed}-{skip}-{uuid.uuid4().hex[:8]}"
    tokens, _, rd = two_legs(p, d, prompt, MAX_TOKENS, tid, skip=skip)
    assert rd is not None and rd.status_code == 200, rd and rd.text
    assert tokens == hf_greedy(ckpt, prompt, MAX_TOKENS)
    return final_record(p, tid, "send"), final_record(d, tid, "recv")


# (prompt, D primed with, P skips, D loads): see the module docstring for what each exercises
CASES = {
    # D's prefix ends at a block end that is also P's chunk end: P's first 256-token step
    # pushes nothing, BEGIN opens with the second chunk
    "block-end-chunk-skipped": (700, 256, 256, 444),
    # a block end inside P's first chunk, and a prompt that ends mid-block
    "block-end-mid-chunk": (300, 128, 128, 172),
    # a skip that is no block multiple: the staged suffix starts mid-block (token 200); D's hit
    # (256) is past it, so D loads from 256, 56 rows into the staged chunk
    "skip-mid-block": (300, 256, 200, 44),
    # D holds more than predicted (a stale prediction on the safe side): D loads less than was
    # moved, from 384, inside the staged chunk [256, 512)
    "d-holds-more": (700, 384, 128, 316),
}


@pytest.mark.parametrize("case", list(CASES))
def test_p_moves_only_the_suffix_and_d_loads_from_its_own_hit(
        llama_pair: tuple[Worker, Worker], llama_ckpt: Path, case: str) -> None:
    n, primed, skip, loaded = CASES[case]
    sent, recv = delta(llama_pair, llama_ckpt, n, primed, skip, 700 + list(CASES).index(case))
    for rec in sent, recv:
        assert (rec["tokens"], rec["skipped_tokens"], rec["bytes"]) == (
            n - skip, skip, (n - skip) * BYTES_PER_TOKEN), rec
    assert sent["status"] == "complete" and recv["status"] == "loaded", recv
    assert recv["loaded_tokens"] == loaded


def test_d_holds_all_but_the_last_prompt_token(llama_pair: tuple[Worker, Worker],
                                               llama_ckpt: Path) -> None:
    """A 257-token prompt whose first 256 tokens D holds: one token moves, one is loaded."""
    sent, recv = delta(llama_pair, llama_ckpt, 257, 256, 256, 720)
    assert (sent["tokens"], recv["tokens"], recv["loaded_tokens"]) == (1, 1, 1)
    assert recv["status"] == "loaded"


def test_d_holds_the_whole_prompt(llama_pair: tuple[Worker, Worker], llama_ckpt: Path) -> None:
    """A 256-token prompt D holds whole: the router's 256 is clamped to 255 so that the transfer
    is never empty (one token moves); D's hit covers all of P's prompt (its own prompt is one
    token longer, t1, which it computes), so it loads nothing and frees the staged token."""
    sent, recv = delta(llama_pair, llama_ckpt, 256, 256, 256, 721)
    assert (sent["tokens"], sent["skipped_tokens"], recv["tokens"]) == (1, 255, 1)
    assert recv["status"] == "discarded" and recv["loaded_tokens"] is None


@pytest.mark.parametrize(("primed", "seed"), [(0, 730), (128, 731)])
def test_a_stale_prediction_fails_the_load_and_d_recomputes_exactly(
        llama_pair: tuple[Worker, Worker], llama_ckpt: Path, primed: int, seed: int) -> None:
    """P skips 256 tokens D does not hold (never had them, or holds only the first block): D's
    load fails (`prefix_not_cached`) and D recomputes its prompt, exact."""
    sent, recv = delta(llama_pair, llama_ckpt, 500, primed, 256, seed)
    assert sent["status"] == "complete" and sent["skipped_tokens"] == 256
    assert (recv["status"], recv["cause"], recv["loaded_tokens"]) == (
        "failed", "prefix_not_cached", None)


def test_bytes_moved_shrink_with_the_skipped_prefix(llama_pair: tuple[Worker, Worker],
                                                    llama_ckpt: Path) -> None:
    """The same 1,000-token shape with and without D's first 512 tokens cached and skipped:
    the bytes on both sides shrink by exactly the skipped tokens' share."""
    _, full = delta(llama_pair, llama_ckpt, 1000, 0, 0, 740)
    _, part = delta(llama_pair, llama_ckpt, 1000, 512, 512, 741)
    assert full["skipped_tokens"] == 0 and part["skipped_tokens"] == 512
    assert part["bytes"] * 1000 == full["bytes"] * (1000 - 512)
    print(f"KV bytes moved for a 1,000-token prompt: {full['bytes']} without skip, "
          f"{part['bytes']} with D's first 512 tokens skipped")
