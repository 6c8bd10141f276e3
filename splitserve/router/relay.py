"""D's leg as the client sees it: D's SSE events turned into the client's chunks, with the
tokens D replays (generates again after loading a transfer that ends before them) checked
against what the client already has and dropped."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from splitserve.router.failures import RETRYABLE_STATUS, LegFailed, UpstreamError
from splitserve.router.formats import Joiner
from splitserve.router.legs import drop_replayed
from splitserve.router.timings import Timings


async def relay(r: aiohttp.ClientResponse, joiner: Joiner, t: Timings, replayed: int,
                on_first: Callable[[], None]) -> AsyncIterator[dict[str, Any]]:
    """D's SSE events as the client's chunks. Reads the body to its end (past `[DONE]`), so a
    finished leg's connection is reused rather than closed. `replayed`: tokens D generates
    again first, dropped here once checked against what the client has (a mismatch is a
    `LegFailed`); `on_first()` runs when D's first chunk with choices arrives. An error event
    with a status worth a retry (vLLM writes one when its engine fails mid-stream: 500) is a
    `LegFailed`, resumed elsewhere as a cut stream is; any other is the answer
    (`UpstreamError`)."""
    rest = b""
    async for piece in r.content.iter_any():
        lines = (rest + piece if rest else piece).split(b"\n")
        rest = lines.pop()  # an unterminated line waits for the next piece
        for line in lines:
            if not line.startswith(b"data: {"):
                continue  # blank separators, comments, and `data: [DONE]`
            obj = json.loads(line[6:])
            if "error" in obj:
                status = error_status(obj["error"])
                if status in RETRYABLE_STATUS:
                    raise LegFailed("stream_error", str(obj["error"])[:200], status)
                raise UpstreamError(status, obj)
            if obj.get("usage"):
                t.d_usage = obj["usage"]
            choices = obj.get("choices")
            if not choices:
                continue
            c = choices[0]
            if t.d_first is None:
                t.d_first = time.monotonic()
                on_first()
            ids = list(c.get("token_ids") or [])
            text = c.get("text") or ""
            if ids:
                t.d_chunks += 1
                t.d_tokens += len(ids)
            if replayed:
                ids, text, replayed = drop_chunk_replay(joiner, ids, text, replayed)
                if not ids and c.get("finish_reason") is None:
                    continue
            yield joiner.tokens(text, ids, c.get("finish_reason"), c.get("stop_reason"))


def drop_chunk_replay(joiner: Joiner, ids: list[int], text: str, pending: int
                      ) -> tuple[list[int], str, int]:
    """One chunk of D's stream less the tokens it replays: (ids, text, still pending)."""
    try:
        rest = drop_replayed(ids, joiner.produced, pending)
    except ValueError as exc:
        raise LegFailed("replay_mismatch", str(exc)) from exc
    if rest and joiner.text_stream is None:
        # the worker's text of the new tokens cannot be told apart from the replayed ones
        raise LegFailed("replay_mismatch", "a chunk mixes replayed and new tokens")
    return rest, text if rest else "", pending - (len(ids) - len(rest))


def error_status(err: Any) -> int:
    """The HTTP status an error event carries (vLLM's `code`); 500 when it names none."""
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else 500
