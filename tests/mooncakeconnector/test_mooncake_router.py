"""vLLM's MooncakeConnector driven by splitserve's router (`legs.mooncake`: both legs at once, D
pulls P's blocks): every request ends complete and token-exact against transformers (greedy
float32), and every live worker's KV comes back.

- 1P1D, whole prompt: D pulls every prompt token from P and computes none.
- A prompt sharing its first blocks with an earlier one: D pulls only the blocks it lacks.
- P killed while it holds the prompt (SIGSTOPped first, so D's leg waits for it): the router
  retries on the other P under a fresh transfer id, and the first D leg is aborted.
- D killed mid-stream: resumed on the other D, one unbroken stream.
- The client leaves at t1: both legs end; P's blocks come back within its lease.
Each case routes to the workers it names (the others drained), so the cases also run alone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.mooncake import MooncakeWorkers
from tests.support.nixl_helpers import stream_tokens, tokens_by_source, wait_kv_free
from tests.support.routers import Router, start_router
from tests.support.workers import chat_prompt_ids, hf_greedy

MAX_TOKENS = 16
LONG = 1500  # prompt tokens: a dozen blocks for D to pull


@pytest.fixture(scope="module")
def router(mooncake: MooncakeWorkers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = start_router(tmp_path_factory.mktemp("mooncake-router"),
                     "--prefill", mooncake.p1.url, mooncake.p2.url,
                     "--decode", mooncake.d1.url, mooncake.d2.url)
    try:
        r.wait_kv_endpoints()
        yield r
    finally:
        r.stop()


def prompt_ids(seed: int, n: int = LONG) -> list[int]:
    return [3 + (seed * 37 + i * 13) % 1000 for i in range(n)]


def completion(model: str | Path, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def test_split_is_exact_and_d_pulls_only_what_it_lacks(router: Router,
                                                       mooncake: MooncakeWorkers) -> None:
    p, d = mooncake.p1, mooncake.d1
    router.route_only(p.url, d.url)
    model = Path(p.cfg.model)
    first = prompt_ids(1)
    before = tokens_by_source(d)
    tokens, timings = stream_tokens(router.url, "/v1/completions", completion(model, first))
    assert tokens == hf_greedy(model, first, MAX_TOKENS)
    assert timings["mode"] == "split" and timings["transfer_id"], timings
    got = tokens_by_source(d)
    assert got["external_kv_transfer"] - before["external_kv_transfer"] == len(first)
    assert got["local_compute"] == before["local_compute"]  # D computed no prompt token

    # the same first 1,024 tokens (8 blocks D now caches), then a new tail
    second = first[:1024] + prompt_ids(2, 300)
    tokens, _ = stream_tokens(router.url, "/v1/completions", completion(model, second))
    assert tokens == hf_greedy(model, second, MAX_TOKENS)
    after = tokens_by_source(d)
    assert after["local_cache_hit"] - got["local_cache_hit"] == 1024
    assert after["external_kv_transfer"] - got["external_kv_transfer"] == len(second) - 1024

    messages = [{"role": "user", "content": "Name the harbour's boats, one by one."}]
    want = hf_greedy(model, chat_prompt_ids(str(model), messages), MAX_TOKENS)
    body = {"model": str(model), "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    tokens, _ = stream_tokens(router.url, "/v1/chat/completions", body)
    assert tokens == want
    wait_kv_free(p, d, timeout_s=15)


def test_p_killed_holding_the_prompt_is_retried_on_another_p(router: Router,
                                                             mooncake: MooncakeWorkers) -> None:
    p, spare, d = mooncake.p2, mooncake.p1, mooncake.d1
    router.route_only(p.url, d.url)
    model = Path(p.cfg.model)
    prompt = prompt_ids(3)
    want = hf_greedy(model, prompt, MAX_TOKENS)
    os.killpg(p.proc.pid, signal.SIGSTOP)  # P holds the request; D's leg waits for P
    result: dict[str, object] = {}

    def client() -> None:
        result["out"] = stream_tokens(router.url, "/v1/completions", completion(model, prompt))

    thread = threading.Thread(target=client)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not any(w["url"] == d.url and w["inflight"] for w in router.workers()):
            assert time.monotonic() < deadline, router.workers()
            time.sleep(0.05)
        time.sleep(0.5)  # both legs are out
        router.drain(spare.url, False)
    finally:
        p.kill()  # SIGKILL reaches a stopped process
    thread.join(120)
    tokens, timings = result["out"]  # type: ignore[misc]
    assert tokens == want
    assert timings["retries"] == 1 and timings["prefill"] == spare.url, timings
    router.wait_idle()
    wait_kv_free(spare, d, timeout_s=spare.cfg.lease_s + 20)


def test_d_killed_mid_stream_resumes_unbroken(router: Router, mooncake: MooncakeWorkers) -> None:
    p, d, rescue = mooncake.p1, mooncake.d2, mooncake.d1
    router.route_only(p.url, d.url)
    model = Path(p.cfg.model)
    prompt = prompt_ids(4)
    want = hf_greedy(model, prompt, 48)

    def kill_d(n: int) -> None:
        if n >= 4 and d.proc.poll() is None:  # t1 from P and three tokens from D
            router.drain(rescue.url, False)
            d.kill()

    tokens, timings = stream_tokens(router.url, "/v1/completions",
                                    completion(model, prompt, 48), kill_d)
    assert d.proc.poll() is not None
    assert tokens == want
    assert timings["retries"] == 1 and timings["decode"] == rescue.url, timings
    wait_kv_free(p, rescue, timeout_s=15)  # D had pulled P's blocks: P freed them at once


def test_client_gone_at_t1_ends_both_legs(router: Router, mooncake: MooncakeWorkers) -> None:
    p, d = mooncake.p1, mooncake.d1
    router.route_only(p.url, d.url)
    body = completion(p.cfg.model, prompt_ids(5), max_tokens=400) | {"stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["token_ids"]:
                break  # t1: leaving the block closes the connection
    router.wait_idle()
    wait_kv_free(d, timeout_s=15)
    wait_kv_free(p, timeout_s=p.cfg.lease_s + 20)
