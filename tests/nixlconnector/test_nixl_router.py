"""splitserve's router in front of the shared NIXL 1P1D: the router drives NixlConnector's two
legs (`router.legs.nixl`).

Through the router, greedy float32 output equals transformers for completions and chat,
streamed and not, concurrently, at lengths that fill their last block exactly and that do not;
D loads P's blocks (it computes no prompt token); afterwards P's and D's KV is free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.nixl_helpers import stream_tokens, tokens_by_source, wait_kv_free
from tests.support.routers import Router, start_router
from tests.support.workers import Worker, chat_prompt_ids, hf_greedy

MAX_TOKENS = 10
# vLLM-CPU's block is 128 tokens: a partial last block, exactly one and two whole blocks, more
LENGTHS = (100, 128, 256, 300)


def prompt_of(length: int, seed: int) -> list[int]:
    return [7 + (seed * 29 + i * 11) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def nixl_router(nixl_pd: tuple[Worker, Worker], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Router]:
    p, d = nixl_pd
    r = start_router(tmp_path_factory.mktemp("nixl-router"), "--prefill", p.url,
                     "--decode", d.url)
    try:
        r.wait_kv_endpoints()
        yield r
    finally:
        r.stop()


def test_router_split_over_nixl_matches_transformers(nixl_router: Router,
                                                     nixl_pd: tuple[Worker, Worker]) -> None:
    p, d = nixl_pd
    model = Path(p.cfg.model)
    wait_kv_free(p, d, timeout_s=30)
    before = tokens_by_source(d)
    # every case its own prompt: no prefix of one is in D's cache from another
    cases = [(prompt_of(n, 2 * i + stream), bool(stream)) for i, n in enumerate(LENGTHS)
             for stream in (0, 1)]

    def run(case: tuple[list[int], bool]) -> tuple[list[int], dict[str, Any]]:
        prompt, stream = case
        body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if stream:
            return stream_tokens(nixl_router.url, "/v1/completions", body)
        rid = f"nixl-router-{len(prompt)}"
        r = httpx.post(f"{nixl_router.url}/v1/completions", json=body,
                       headers={"X-Request-Id": rid}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == rid
        return r.json()["choices"][0]["token_ids"], json.loads(r.headers["x-splitserve-timings"])

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(run, cases))
    for (prompt, stream), (tokens, timings) in zip(cases, got, strict=True):
        assert tokens == hf_greedy(model, prompt, MAX_TOKENS), (len(prompt), stream)
        assert timings["mode"] == "split" and timings["retries"] == 0, timings
        assert timings["transfer_id"], timings  # the pair moved KV over NixlLegs
    after = tokens_by_source(d)
    # D loaded every prompt token of every request and computed none of them
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    computed = after["local_compute"] - before["local_compute"]
    assert (loaded, computed) == (sum(len(pr) for pr, _ in cases), 0)
    wait_kv_free(p, d, timeout_s=15)


def test_router_chat_over_nixl_matches_transformers(nixl_router: Router,
                                                    nixl_pd: tuple[Worker, Worker]) -> None:
    model = nixl_pd[0].cfg.model
    messages = [{"role": "user", "content": "Name the brightest star."}]
    prompt = chat_prompt_ids(model, messages)
    want = hf_greedy(Path(model), prompt, MAX_TOKENS)
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{nixl_router.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    tokens, timings = stream_tokens(nixl_router.url, "/v1/chat/completions", body)
    assert tokens == want and timings["mode"] == "split", timings
