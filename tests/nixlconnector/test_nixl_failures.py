"""Failures over vLLM's NixlConnector through splitserve's router: every request ends complete
and token-exact against transformers (greedy float32), and every live worker's KV comes back.

The workers that die are this module's own (a P and two Ds, `spares`); the session's NIXL 1P1D
is never killed: its P prefills the mid-stream case and its D is where a failed D leg resumes
(by recomputation: it reads no KV of the dead D's transfer). Each case routes to the workers it
names (every other one drained on the router), so the cases also run alone, in file order.

- D killed while it pulls P's blocks: P is paused (SIGSTOP) the moment the client has t1, so
  D's pull cannot finish; once D holds the blocks it pulls into, D is SIGKILLed and P resumed.
  The stream resumes on another D; P frees the blocks no D read when its KV lease runs out.
- P killed after t1, before D read its blocks: D's pull fails (vLLM counts a failed transfer),
  D recomputes the prompt itself (`kv_load_failure_policy: recompute`, the workers' default)
  and the stream completes on the same D, with no retry.
- D killed mid-stream: resumed on another D, one unbroken stream; P already freed its blocks
  (D had read them).
- The client leaves at t1: D's leg is aborted (D never finishes the request) and holds nothing;
  P's blocks come back within its lease.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.nixl_helpers import (
    NIXL_LEASE_S,
    finished_by_reason,
    stream_tokens,
    tokens_by_source,
    wait_kv_free,
)
from tests.support.routers import Router, start_router
from tests.support.workers import (
    Worker,
    chat_prompt_ids,
    hf_greedy,
    launch_together,
    metric_sum,
    stop_all,
)

MAX_TOKENS = 16
LONG = 1500  # prompt tokens: a dozen blocks for D to pull
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"  # P: blocks freed by the lease, unread
FAILED = "vllm:nixl_num_failed_transfers_total"  # D: pulls that failed


@dataclass(frozen=True)
class Spares:
    p: Worker
    d1: Worker
    d2: Worker


@pytest.fixture(scope="module")
def spares(nixl_ckpt: Path) -> Iterator[Spares]:
    """This module's own NIXL P (core 0) and two Ds (core 1): the workers its tests kill."""
    common = {"connector": "nixl", "lease_s": NIXL_LEASE_S}
    p, d1, d2 = launch_together(
        nixl_ckpt,
        ("nixl-fail-p", "prefill", common | {"cpus": (0,), "max_num_batched_tokens": 256}),
        ("nixl-fail-d1", "decode", common | {"cpus": (1,)}),
        ("nixl-fail-d2", "decode", common | {"cpus": (1,)}))
    yield Spares(p, d1, d2)
    stop_all(p, d1, d2)


@pytest.fixture(scope="module")
def router(spares: Spares, nixl_pd: tuple[Worker, Worker],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """One router over every P and D here; each test drains all but the workers it uses."""
    p, d = nixl_pd
    r = start_router(tmp_path_factory.mktemp("nixl-fail-router"),
                     "--prefill", spares.p.url, p.url,
                     "--decode", spares.d1.url, spares.d2.url, d.url)
    try:
        deadline = time.monotonic() + 30
        while not all(w["healthy"] for w in r.workers()):
            assert time.monotonic() < deadline, r.workers()
            time.sleep(0.2)
        yield r
    finally:
        r.stop()


def long_prompt(seed: int) -> list[int]:
    return [3 + (seed * 37 + i * 13) % 1000 for i in range(LONG)]


def completion(model: str | Path, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def group_signal(w: Worker, sig: signal.Signals) -> None:
    os.killpg(w.proc.pid, sig)


def wait_holding(w: Worker, timeout_s: float) -> None:
    """Until the worker holds KV blocks (for a D: the blocks it pulls into)."""
    deadline = time.monotonic() + timeout_s
    while w.kv_usage() == 0.0:
        assert time.monotonic() < deadline, f"{w.url} never allocated blocks"
        time.sleep(0.02)


def test_d_killed_while_pulling_resumes_on_another_d(
        router: Router, spares: Spares, nixl_pd: tuple[Worker, Worker]) -> None:
    p, d, rescue = spares.p, spares.d2, nixl_pd[1]
    router.route_only(p.url, d.url)
    wait_kv_free(p, d, rescue, timeout_s=NIXL_LEASE_S + 20)
    prompt = long_prompt(1)
    want = hf_greedy(Path(p.cfg.model), prompt, MAX_TOKENS)
    expired = metric_sum(p, EXPIRED)
    killed: list[bool] = []

    def kill_d_mid_pull(n: int) -> None:
        if killed:
            return
        group_signal(p, signal.SIGSTOP)  # D's pull of P's blocks cannot finish while P sleeps
        try:
            wait_holding(d, timeout_s=4.0)  # under NIXL's 5 s handshake timeout
            router.drain(rescue.url, False)
            d.kill()
            killed.append(True)
        finally:
            group_signal(p, signal.SIGCONT)

    tokens, timings = stream_tokens(router.url, "/v1/completions", completion(p.cfg.model, prompt),
                                    kill_d_mid_pull)
    assert killed and d.proc.poll() is not None
    assert tokens == want
    assert timings["retries"] == 1 and timings["decode"] == rescue.url, timings
    assert p.kv_usage() > 0  # the blocks D never read are still P's ...
    wait_kv_free(p, rescue, timeout_s=NIXL_LEASE_S + 20)
    assert metric_sum(p, EXPIRED) == expired + 1  # ... until the lease frees them


def test_p_killed_before_d_reads_its_blocks_d_recomputes(
        router: Router, spares: Spares, nixl_ckpt: Path) -> None:
    p, d = spares.p, spares.d1
    router.route_only(p.url, d.url)
    prompt = long_prompt(2)
    want = hf_greedy(nixl_ckpt, prompt, MAX_TOKENS)
    failed, computed = metric_sum(d, FAILED), tokens_by_source(d)["local_compute"]

    def kill_p(n: int) -> None:
        p.kill()  # the client has t1; D's leg has barely begun

    tokens, timings = stream_tokens(router.url, "/v1/completions", completion(nixl_ckpt, prompt),
                                    kill_p)
    assert p.proc.poll() is not None
    assert tokens == want
    assert timings["retries"] == 0 and timings["decode"] == d.url, timings
    assert metric_sum(d, FAILED) == failed + 1  # D's pull failed, and D computed the prompt
    assert tokens_by_source(d)["local_compute"] - computed == len(prompt)
    wait_kv_free(d, timeout_s=15)


def test_d_killed_mid_stream_resumes_unbroken(
        router: Router, spares: Spares, nixl_pd: tuple[Worker, Worker]) -> None:
    (p, rescue), d = nixl_pd, spares.d1
    router.route_only(p.url, d.url)
    model = p.cfg.model
    messages = [{"role": "user", "content": "Count the stars over the harbour, one by one."}]
    want = hf_greedy(Path(model), chat_prompt_ids(model, messages), 48)
    body = {"model": model, "messages": messages, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}

    def kill_d(n: int) -> None:
        if n >= 4 and d.proc.poll() is None:  # t1 from P and three tokens from D
            router.drain(rescue.url, False)
            d.kill()

    tokens, timings = stream_tokens(router.url, "/v1/chat/completions", body, kill_d)
    assert d.proc.poll() is not None
    assert tokens == want
    assert timings["retries"] == 1 and timings["decode"] == rescue.url, timings
    wait_kv_free(p, rescue, timeout_s=15)  # D had read P's blocks: P freed them at once


def test_client_gone_at_t1_aborts_d_and_p_frees_within_its_lease(
        router: Router, nixl_pd: tuple[Worker, Worker]) -> None:
    p, d = nixl_pd
    router.route_only(p.url, d.url)
    wait_kv_free(p, d, timeout_s=NIXL_LEASE_S + 20)
    before = finished_by_reason(d)
    body = completion(p.cfg.model, long_prompt(3), max_tokens=400) | {"stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["token_ids"]:
                break  # t1: leaving the block closes the connection before D's first token
    router.wait_idle()
    wait_kv_free(d, timeout_s=10)
    assert finished_by_reason(d)["length"] == before["length"]  # D never finished it
    wait_kv_free(p, timeout_s=NIXL_LEASE_S + 20)
