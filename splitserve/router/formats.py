"""OpenAI wire formats: the events and bodies the router sends, shaped exactly as vLLM's own
server shapes them (vLLM 0.32), so a joined stream is indistinguishable from a colocated one
apart from ids and timestamps.

`Joiner` owns one request's output: it is fed t1 (from P) and then D's tokens, and it counts
tokens itself, so usage is the original prompt plus every generated token exactly once, whichever
workers produced them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from splitserve.router.detok import TextStream
from splitserve.router.params import Legs


def error_body(message: str, err_type: str = "BadRequestError", param: str | None = None,
               code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"),
                                                       ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def sse_comment(name: str, obj: dict[str, Any]) -> bytes:
    """An SSE comment line: ignored by every SSE client, so it adds no event to the stream."""
    return f": {name} {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


DONE = b"data: [DONE]\n\n"
RID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(given: str | None) -> str:
    """The client's `X-Request-Id` when it is a sane token, else a fresh one."""
    return given if given and RID_RE.match(given) else uuid.uuid4().hex


class Joiner:
    """Builds the client's events for one request from t1 and D's tokens."""

    def __init__(self, legs: Legs, request_id: str, model: str) -> None:
        self.legs = legs
        self.chat = legs.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.model = model
        self.created = int(time.time())
        self.prompt_ids: list[int] = []
        self.produced: list[int] = []
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.fingerprint: str | None = None
        self.text_stream: TextStream | None = None  # set: text is the router's, not D's

    # --- streaming events -------------------------------------------------------------------
    def _usage(self, details: bool) -> dict[str, Any]:
        n_prompt, n_out = len(self.prompt_ids), len(self.produced)
        usage: dict[str, Any] = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
                                 "completion_tokens": n_out}
        if details:
            usage["completion_tokens_details"] = None
        return usage

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}

    def start(self, prompt_ids: list[int], fingerprint: str | None) -> list[dict[str, Any]]:
        """Events sent before any token (chat's role chunk)."""
        self.prompt_ids = list(prompt_ids)
        self.fingerprint = fingerprint
        if not self.chat:
            return []
        chunk = self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
        if self.legs.continuous_usage:
            chunk["usage"] = self._usage(details=True)
        chunk["prompt_token_ids"] = self.prompt_ids if self.legs.return_token_ids else None
        chunk["prompt_text"] = None
        return [chunk]

    def tokens(self, text: str, token_ids: list[int], finish_reason: str | None,
               stop_reason: int | str | None) -> dict[str, Any]:
        """One token chunk. The first one carries the prompt ids (completions), as vLLM's does."""
        first = not self.produced
        if self.text_stream is not None:
            if first:  # t1's text is P's own, from the same state
                self.text_stream.known(token_ids)
            else:
                text = self.text_stream.text(token_ids, finish_reason)
        self.produced += token_ids
        self.texts.append(text)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        ids = list(token_ids) if self.legs.return_token_ids else None
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                      "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = ids
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": stop_reason,
                      "prompt_token_ids": (self.prompt_ids if first and self.legs.return_token_ids
                                           else None),
                      "token_ids": ids}
        chunk = self._chunk([choice])
        if self.legs.continuous_usage:
            chunk["usage"] = self._usage(details=self.chat)
        if finish_reason is not None and not self.legs.include_usage:
            chunk["system_fingerprint"] = self.fingerprint
        return chunk

    def end(self) -> list[dict[str, Any]]:
        """Events after the last token: the usage chunk when asked for."""
        if not self.legs.include_usage:
            return []
        chunk = self._chunk([])
        chunk["usage"] = self._usage(details=False)
        chunk["system_fingerprint"] = self.fingerprint
        return [chunk]

    # --- non-streaming body -----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        rti = self.legs.return_token_ids
        text = "".join(self.texts)
        usage = self._usage(details=False) | {"prompt_tokens_details": None,
                                              "completion_tokens_details": None}
        head = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model}
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None,
                       "annotations": None, "audio": None, "function_call": None,
                       "reasoning": None}
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                      "token_ids": self.produced if rti else None, "routed_experts": None}
            return head | {"choices": [choice], "service_tier": None,
                           "system_fingerprint": self.fingerprint, "usage": usage,
                           "prompt_logprobs": None,
                           "prompt_token_ids": self.prompt_ids if rti else None,
                           "prompt_text": None, "kv_transfer_params": None,
                           "ec_transfer_params": None, "metrics": None}
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                  "token_ids": self.produced if rti else None, "prompt_logprobs": None,
                  "prompt_token_ids": self.prompt_ids if rti else None, "routed_experts": None}
        return head | {"choices": [choice], "service_tier": None,
                       "system_fingerprint": self.fingerprint, "usage": usage,
                       "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
