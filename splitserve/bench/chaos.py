"""Chaos client: streamed requests whose every outcome is classified against a reference.

A request sent during failures ends in exactly one of:
- `complete`: the stream ended with a finish reason and `[DONE]`, and its tokens equal the
  reference (an undisturbed greedy run);
- `error`: an explicit error — a non-200 answer with an OpenAI-style error body, or an SSE
  `data: {"error": …}` event followed by `data: [DONE]`;
- `cancelled`: the client itself disconnected on purpose;
- `wrong`: it finished, but with other tokens than the reference (a 200 with bad tokens);
- `lost`: anything else — a stream cut without an error, no finish reason, no `[DONE]`.
`wrong` and `lost` must never happen.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

OUTCOMES = ("complete", "error", "cancelled", "wrong", "lost")
# Transfer faults by request id (connector/faults.py); the crash markers act only on workers
# started with SPLITSERVE_FAULTS=1,crash.
FAULTS = ("", "fault-corrupt", "fault-delay", "fault-drop", "fault-short", "fault-crash-p",
          "fault-crash-d", "")


@dataclass(frozen=True)
class ChaosRequest:
    rid: str  # carries the request's fault marker
    prompt: list[int]
    hang_up_after: int | None  # the client disconnects after this many tokens


def chaos_requests(tag: str, n: int, rng: random.Random, vocab: int, max_prompt: int,
                   crashes: bool = True) -> list[ChaosRequest]:
    """`n` requests cycling through FAULTS (crash markers left out unless `crashes`); every
    fifth client hangs up after a few tokens."""
    out = []
    for i in range(n):
        fault = FAULTS[i % len(FAULTS)]
        if not crashes and "crash" in fault:
            fault = ""
        prompt = [3 + rng.randrange(vocab - 3) for _ in range(rng.randrange(16, max_prompt))]
        out.append(ChaosRequest(f"{tag}-{i}{'-' + fault if fault else ''}", prompt,
                                rng.randrange(2, 10) if i % 5 == 4 else None))
    return out


def run_wave(url: str, reqs: list[ChaosRequest], max_tokens: int, timeout_s: float = 300.0
             ) -> list[Outcome]:
    """Send every request at once (greedy, `ignore_eos`) and wait for all of them to end."""
    async def go() -> list[Outcome]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            return await asyncio.gather(*(
                stream_one(client, url, {"prompt": r.prompt, "max_tokens": max_tokens,
                                         "temperature": 0, "ignore_eos": True,
                                         "return_token_ids": True}, r.rid, r.hang_up_after)
                for r in reqs))
    return asyncio.run(go())


@dataclass
class Outcome:
    rid: str
    status: int | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    disconnected: bool = False
    transport_error: str | None = None
    seconds: float = 0.0


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], rid: str,
                     disconnect_after: int | None = None) -> Outcome:
    """POST a streamed completion; record everything that came back. With `disconnect_after`,
    hang up once that many tokens arrived (a client going away mid-stream)."""
    out = Outcome(rid)
    t0 = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True},
                                 headers={"X-Request-Id": rid}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                try:
                    out.error = json.loads(await r.aread()).get("error")
                except ValueError:
                    out.error = None
                return out
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = event["error"]
                    for choice in event.get("choices", []):
                        out.tokens += choice.get("token_ids") or []
                        out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if disconnect_after is not None and len(out.tokens) >= disconnect_after:
                    out.disconnected = True
                    return out
    except (httpx.TransportError, ValueError) as exc:
        out.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        out.seconds = time.monotonic() - t0
    return out


def classify(o: Outcome, reference: list[int]) -> str:
    if o.disconnected:
        return "cancelled"
    if o.status is not None and o.status != 200:
        explicit = isinstance(o.error, dict) and bool(o.error.get("message"))
        return "error" if explicit else "lost"
    if o.error is not None:
        return "error" if o.done and bool(o.error.get("message")) else "lost"
    if not o.done or o.finish_reason is None or o.transport_error:
        return "lost"
    return "complete" if o.tokens == reference else "wrong"


def summarize(outcomes: list[Outcome], references: dict[str, list[int]]) -> dict[str, Any]:
    """Counts per outcome (every one of OUTCOMES present), plus the requests that went wrong."""
    kinds = {o.rid: classify(o, references[o.rid]) for o in outcomes}
    counts = Counter(kinds.values())
    return {"sent": len(outcomes), **{k: counts.get(k, 0) for k in OUTCOMES},
            "bad": [{"rid": o.rid, "outcome": kinds[o.rid], "status": o.status,
                     "tokens": len(o.tokens), "finish_reason": o.finish_reason,
                     "error": o.error, "transport_error": o.transport_error}
                    for o in outcomes if kinds[o.rid] in ("wrong", "lost")],
            "errors": [{"rid": o.rid, "status": o.status, "error": o.error}
                       for o in outcomes if kinds[o.rid] == "error"]}
