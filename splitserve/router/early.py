"""D's first leg sent together with P's, for connectors whose legs go at once
(`legs.LegProtocol.concurrent`, e.g. Mooncake: D waits for P's prefill and pulls the KV).

Contract: `EarlyDecode.send` starts D's streaming POST at once and returns without waiting; the
leg is then either taken over by `Flow.decode` (`response`, once) or aborted (`abort`,
idempotent, never raises): closing its connection aborts the request in vLLM, whose connector
then frees what it reserved on D and tells P. Every EarlyDecode ends one of the two ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp

from splitserve.router.legs import Transfer
from splitserve.router.params import Legs, decode_body

JSON_HEADERS = {"Content-Type": "application/json"}


def early_decode_body(legs: Legs, model: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    """D's body when it goes out with P's: the request's own prompt (D tokenizes and truncates
    it as P does) and whole budget, streaming with token ids, and D's `kv_transfer_params`."""
    body = decode_body(legs, model, [], [], kv)
    body["prompt"] = legs.prompt
    if "truncate_prompt_tokens" in legs.tokenwise:
        body["truncate_prompt_tokens"] = legs.tokenwise["truncate_prompt_tokens"]
    return body


class EarlyDecode:
    """One D leg in flight since P's attempt went out."""

    def __init__(self, task: asyncio.Task[aiohttp.ClientResponse], sent: float) -> None:
        self.task = task
        self.sent = sent  # monotonic time it went out (the leg's d_sent)
        self.taken = False

    @classmethod
    def send(cls, session: aiohttp.ClientSession, tr: Transfer, legs: Legs, model: str,
             request_id: str, encode: Any) -> EarlyDecode:
        body = early_decode_body(legs, model, tr.decode_params)
        task = asyncio.get_running_loop().create_task(session.post(
            f"{tr.decode.url}/v1/completions", data=encode(body),
            headers={**JSON_HEADERS, "X-Request-Id": request_id}))
        return cls(task, time.monotonic())

    async def response(self) -> aiohttp.ClientResponse:
        """The leg's response (its headers read); raises what the POST raised. The caller owns
        the response from then on (release or close it)."""
        assert not self.taken, "an early D leg is taken over once"
        self.taken = True
        return await self.task

    def abort(self) -> None:
        """Close the leg unless `Flow.decode` took it over: cancel the POST, or close the
        response it got."""
        if self.taken:
            return
        self.taken = True
        if not self.task.done():
            self.task.cancel()
            return
        with contextlib.suppress(BaseException):
            self.task.result().close()
