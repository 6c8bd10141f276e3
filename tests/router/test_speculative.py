"""Speculative decoding on D over splitserve's connector, through the router: n-gram drafting on
two Ds (P never drafts), on a model whose greedy output repeats itself (`llama-repeats`), so
drafts are made and accepted. Concurrent requests equal transformers token for token while D's
counters show drafts accepted; then the D streaming a long answer is killed and the stream
resumes on the other D, still drafting, exact. The test that kills D2 comes last.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support import cores
from tests.support.drafting import ACCEPTED, DRAFTS, NGRAM
from tests.support.nixl_helpers import stream_tokens
from tests.support.routers import Router, start_router
from tests.support.workers import (
    Worker,
    hf_greedy,
    launch_together,
    make_checkpoint,
    metric_sum,
    stop_all,
)

LENGTHS = (3, 40, 130, 260, 90, 17)
MAX_TOKENS = 96  # each of these prompts' outputs falls into a cycle within 70 tokens


@pytest.fixture(scope="module")
def repeats_ckpt(checkpoint_root: Path) -> Path:
    return make_checkpoint(checkpoint_root, "llama-repeats")


@pytest.fixture(scope="module")
def drafting(repeats_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Worker, Worker, Worker, Router]]:
    """P (no drafting) and two Ds drafting with n-grams, and a router over them."""
    spec = json.dumps(NGRAM)
    p, d1, d2 = launch_together(
        repeats_ckpt,
        ("spec-p", "prefill", {"cpus": cores.PREFILL}),
        ("spec-d1", "decode", {"cpus": cores.DECODE, "speculative_config": spec}),
        ("spec-d2", "decode", {"cpus": cores.DECODE, "speculative_config": spec}))
    try:
        router = start_router(tmp_path_factory.mktemp("router-spec"), "--prefill", p.url,
                              "--decode", d1.url, d2.url)
    except BaseException:
        stop_all(p, d1, d2)
        raise
    yield p, d1, d2, router
    router.stop()
    stop_all(p, d1, d2)  # D2 is killed by the last test: stopping it only reaps it


def prompt_of(n: int) -> list[int]:
    return [7 + (i * 29 + n * 3) % 900 for i in range(n)]


def completion(model: str, prompt: list[int], max_tokens: int) -> dict[str, object]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def test_drafting_on_d_is_token_exact_and_its_drafts_are_accepted(
        drafting: tuple[Worker, Worker, Worker, Router], repeats_ckpt: Path) -> None:
    p, d1, d2, router = drafting
    model = str(p.cfg.model)
    before = {w.url: (metric_sum(w, DRAFTS), metric_sum(w, ACCEPTED)) for w in (d1, d2)}

    def one(n: int) -> tuple[list[int], dict[str, object]]:
        r = httpx.post(f"{router.url}/v1/completions", json=completion(model, prompt_of(n),
                                                                          MAX_TOKENS),
                       timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], json.loads(r.headers["x-splitserve-timings"])

    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        outs = list(pool.map(one, LENGTHS))
    for n, (ids, timings) in zip(LENGTHS, outs, strict=True):
        assert ids == hf_greedy(repeats_ckpt, prompt_of(n), MAX_TOKENS), f"{n} tokens"
        assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
    gained = {w.url: (metric_sum(w, DRAFTS) - before[w.url][0],
                      metric_sum(w, ACCEPTED) - before[w.url][1]) for w in (d1, d2)}
    assert sum(g[0] for g in gained.values()) > 0, gained  # D drafted ...
    assert sum(g[1] for g in gained.values()) > 0, gained  # ... and the model accepted drafts
    assert metric_sum(p, DRAFTS) == 0  # P never drafts (it has no speculative config)
    # a chunk of D's stream carried more than one token: accepted drafts reached the client
    assert max(float(t.get("d_tokens_per_chunk", 0)) for _, t in outs) > 1.0, outs


def test_the_drafting_d_dies_mid_stream_and_the_stream_resumes_exactly_on_the_other_d(
        drafting: tuple[Worker, Worker, Worker, Router], repeats_ckpt: Path) -> None:
    p, d1, d2, router = drafting
    model = str(p.cfg.model)
    prompt, max_tokens = prompt_of(200), 1200
    want = hf_greedy(repeats_ckpt, prompt, max_tokens)
    router.route_only(p.url, d2.url)
    d1_drafts = metric_sum(d1, DRAFTS)
    at_kill: list[int] = []

    def kill_d2(n: int) -> None:
        if n >= 8 and not at_kill:  # t1 from P, then D2's tokens
            router.drain(d1.url, False)  # the other D takes the resumed leg
            d2.kill()
            at_kill.append(n)

    started = time.monotonic()
    tokens, timings = stream_tokens(router.url, "/v1/completions",
                                    completion(model, prompt, max_tokens), kill_d2)
    print(f"\nD2 killed at {at_kill} of {max_tokens} tokens; resumed in "
          f"{time.monotonic() - started:.1f} s in all; timings {timings}")
    assert at_kill and at_kill[0] < max_tokens
    assert tokens == want
    assert timings["retries"] == 1 and timings["decode"] == d1.url, timings
    assert metric_sum(d1, DRAFTS) > d1_drafts  # the resumed leg drafted too
    assert d2.proc.poll() is not None
