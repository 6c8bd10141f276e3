"""Speculative decoding on a NIXL D, through the router: D drafts with n-grams (P does not) on a
model whose greedy output repeats itself, pulls the whole prompt's KV from P (it computes no
prompt token), and its output equals transformers while its counters show drafts accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support import cores
from tests.support.drafting import ACCEPTED, DRAFTS, NGRAM
from tests.support.nixl_helpers import NIXL_LEASE_S, tokens_by_source, wait_kv_free
from tests.support.routers import Router, start_router
from tests.support.workers import (
    Worker,
    hf_greedy,
    launch_together,
    make_checkpoint,
    metric_sum,
    stop_all,
)

LENGTHS = (3, 130, 260, 40)
MAX_TOKENS = 96  # each of these prompts' outputs falls into a cycle within 70 tokens


@pytest.fixture(scope="module")
def nixl_drafting(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Path, Worker, Worker, Router]]:
    ckpt = make_checkpoint(checkpoint_root, "llama-repeats")
    common = {"connector": "nixl", "lease_s": NIXL_LEASE_S}
    p, d = launch_together(
        ckpt, ("nixl-spec-p", "prefill", common | {"cpus": cores.PREFILL}),
        ("nixl-spec-d", "decode", common | {"cpus": cores.DECODE,
                                            "speculative_config": json.dumps(NGRAM)}))
    router = None
    try:
        router = start_router(tmp_path_factory.mktemp("nixl-spec-router"), "--prefill", p.url,
                              "--decode", d.url)
        router.wait_kv_endpoints()
        yield ckpt, p, d, router
    finally:
        if router is not None:
            router.stop()
        stop_all(p, d)


def test_nixl_d_drafts_and_stays_token_exact(
        nixl_drafting: tuple[Path, Worker, Worker, Router]) -> None:
    ckpt, p, d, router = nixl_drafting
    prompts = [[7 + (i * 29 + n * 3) % 900 for i in range(n)] for n in LENGTHS]
    before = tokens_by_source(d)
    drafts, accepted = metric_sum(d, DRAFTS), metric_sum(d, ACCEPTED)

    def one(prompt: list[int]) -> list[int]:
        r = httpx.post(f"{router.url}/v1/completions", timeout=300, json={
            "model": str(p.cfg.model), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert json.loads(r.headers["x-splitserve-timings"])["mode"] == "split"
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(ckpt, prompt, MAX_TOKENS), f"{len(prompt)} tokens"
    assert metric_sum(d, DRAFTS) > drafts and metric_sum(d, ACCEPTED) > accepted
    assert metric_sum(p, DRAFTS) == 0
    after = tokens_by_source(d)  # D loaded every prompt token and computed none of them
    assert (after["external_kv_transfer"] - before["external_kv_transfer"],
            after["local_compute"] - before["local_compute"]) == (sum(map(len, prompts)), 0)
    wait_kv_free(p, d, timeout_s=30)
