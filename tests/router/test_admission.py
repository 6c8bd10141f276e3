"""Overload and shutdown: a flood far above capacity gets fast 429s while accepted requests
complete exactly and memory stays bounded; SIGTERM drains in-flight streams and refuses new work.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.routers import Router, start_router
from tests.support.workers import Worker, hf_greedy, metric_sum

PROMPT = [5 + (i * 29) % 900 for i in range(48)]
PER_WORKER = 2  # the router's queue limit per worker


def body(max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


async def one(client: httpx.AsyncClient, url: str, max_tokens: int) -> dict[str, Any]:
    """One streamed request: status, seconds to the response head and to the end, tokens."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"tokens": [], "done": False}
    async with client.stream("POST", f"{url}/v1/completions", json=body(max_tokens)) as r:
        out["status"], out["head_s"] = r.status_code, time.monotonic() - t0
        out["retry_after"] = r.headers.get("retry-after")
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                for c in json.loads(line[6:]).get("choices", []):
                    out["tokens"] += c.get("token_ids") or []
    out["end_s"] = time.monotonic() - t0
    return out


def worker_load(worker: Worker) -> float:
    """Requests running plus waiting on a worker."""
    return metric_sum(worker, "vllm:num_requests_running", "vllm:num_requests_waiting")


def served(worker: Worker) -> float:
    return metric_sum(worker, "vllm:request_success_total")


def test_flood_gets_fast_429s_accepted_requests_complete_memory_bounded(
        llama_pair: tuple[Worker, Worker], router_logs: Path, llama_ckpt: Path) -> None:
    p, d = llama_pair
    reference = hf_greedy(llama_ckpt, PROMPT, 16)
    router = start_router(router_logs, "--prefill", p.url, "--decode", d.url,
                          "--max-inflight-per-worker", str(PER_WORKER))
    peak = {p.url: 0.0, d.url: 0.0}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            for w in (p, d):
                peak[w.url] = max(peak[w.url], worker_load(w))
            time.sleep(0.05)

    async def wave(client: httpx.AsyncClient, n: int) -> list[dict[str, Any]]:
        return await asyncio.gather(*(one(client, router.url, 16) for _ in range(n)))

    async def flood() -> tuple[list[dict[str, Any]], int, int]:
        proc = psutil.Process(router.proc.pid)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            results = await wave(client, 40)  # warms the router's buffers and pools
            rss_warm = proc.memory_info().rss
            for _ in range(4):
                results += await wave(client, 40)
            return results, rss_warm, proc.memory_info().rss

    served_before = {w.url: served(w) for w in (p, d)}
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        results, rss_warm, rss_end = asyncio.run(flood())
    finally:
        sampling.set()
        sampler.join()
        router.stop()
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(accepted) + len(refused) == len(results), {r["status"] for r in results}
    assert len(accepted) >= PER_WORKER and len(refused) > len(results) // 2
    for r in accepted:  # every accepted request completes, token-exact
        assert r["done"] and r["tokens"] == reference
    for r in refused:
        assert r["retry_after"] and r["error"]["type"] == "RateLimitError"
    # refusals come back at once: the router answered them without touching a worker (each
    # accepted request is one request on P and one on D; a refused one is none)
    for w in (p, d):
        assert served(w) - served_before[w.url] == len(accepted), w.url
    # the workers never held more than the router's limit, and the router's memory is flat
    assert max(peak.values()) <= PER_WORKER, peak
    assert rss_end - rss_warm < 64 * 1024**2, (rss_warm, rss_end)


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(
        llama_pair: tuple[Worker, Worker], router_logs: Path, llama_ckpt: Path) -> None:
    p, d = llama_pair
    max_tokens = 300
    reference = hf_greedy(llama_ckpt, PROMPT, max_tokens)
    router: Router = start_router(router_logs, "--prefill", p.url, "--decode", d.url)
    got: dict[str, Any] = {}
    started = threading.Event()

    def stream() -> None:
        tokens: list[int] = []
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body(max_tokens),
                          timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    for c in json.loads(line[6:]).get("choices", []):
                        tokens += c.get("token_ids") or []
                    if len(tokens) >= 5:
                        started.set()
        got["tokens"] = tokens

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(60)
        router.proc.send_signal(signal.SIGTERM)
        refused = False
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            try:
                httpx.get(f"{router.url}/health", timeout=2)
                time.sleep(0.05)
            except httpx.TransportError:
                refused = True
        assert refused, "the router still accepts connections after SIGTERM"
        reader.join(60)
        assert got.get("done") and got["tokens"] == reference  # the in-flight stream finished
        # it exits by itself once drained (uvicorn re-raises the SIGTERM it handled)
        assert router.proc.wait(30) in (0, -signal.SIGTERM)
        assert "graceful shutdown exceeded" not in router.log.read_text()
    finally:
        router.stop()
