"""The request stream of `ray_peer.py`, and its timing client: OpenAI completions, streamed,
greedy, one request at a time, each event's token ids recorded with its arrival time."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from _common import random_prompt, summary

PROMPT_LENS = (24, 100, 300, 600)  # mixed: a few blocks to most of a 1024-token context
VOCAB = 1024  # the tiny llama's (router_overhead.TINY)


def stream_prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts cycling through `PROMPT_LENS`, each from a fresh seed (no prefix hits)."""
    return [random_prompt(PROMPT_LENS[i % len(PROMPT_LENS)], seed * 100_000 + i, VOCAB)
            for i in range(n)]


def one_request(client: httpx.Client, url: str, model: str, prompt: list[int],
                max_tokens: int) -> dict[str, Any]:
    """Send one streamed request; (TTFT, gaps between token-bearing events, token ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    sent = time.perf_counter()
    arrivals: list[float] = []
    tokens: list[int] = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            ids = [t for c in event.get("choices") or [] for t in c.get("token_ids") or []]
            if ids:
                arrivals.append(time.perf_counter())
                tokens += ids
    if not arrivals:
        raise RuntimeError("the stream carried no token ids")
    return {"ttft": arrivals[0] - sent,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tpot": (arrivals[-1] - arrivals[0]) / max(1, len(tokens) - 1),
            "events": len(arrivals), "tokens": tokens}


def first_answer(url: str, model: str | None, deadline_s: float) -> str:
    """Poll until `url` answers a one-token completion; the served model's name."""
    end = time.monotonic() + deadline_s
    last = ""
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < end:
            try:
                name = model or client.get(f"{url}/v1/models").json()["data"][0]["id"]
                r = client.post(f"{url}/v1/completions", json={
                    "model": name, "prompt": [11, 12, 13], "max_tokens": 1, "temperature": 0})
                if r.status_code == 200:
                    return str(name)
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {deadline_s:.0f} s (last: {last})")


def run_stream(url: str, model: str, prompts: list[list[int]], max_tokens: int,
               warmup: int) -> dict[str, Any]:
    """Warm-up requests (not counted), then the stream; per-request results and summaries."""
    with httpx.Client(timeout=120) as client:
        for i in range(warmup):
            one_request(client, url, model, [7 + i, 8, 9, 10], max_tokens)
        results = [one_request(client, url, model, p, max_tokens) for p in prompts]
    gaps = [g for r in results for g in r["gaps"]]
    return {"ttft": summary([r["ttft"] for r in results]), "itl": summary(gaps),
            "tpot": summary([r["tpot"] for r in results]),
            "events_per_request": [r["events"] for r in results],
            "outputs": [r["tokens"] for r in results]}
