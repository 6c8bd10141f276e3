"""P's answer to the prefill leg (`max_tokens: 1`), read once and checked: what the router uses
of it. Anything out of shape is `LegFailed("bad_answer")`, a failed attempt retried elsewhere,
so no malformed answer can fail a request after D was reserved for it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from splitserve.router.failures import LegFailed


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value)


@dataclass(frozen=True)
class PrefillAnswer:
    prompt_ids: list[int]  # the prompt as P tokenized it (empty when P did not return it)
    text: str  # t1's text
    token_ids: list[int]  # t1
    finish_reason: str | None
    stop_reason: str | int | None
    fingerprint: str | None
    usage: dict[str, Any] | None
    body: dict[str, Any]  # the whole answer, for the leg protocol (`kv_transfer_params`)

    @classmethod
    def parse(cls, raw: bytes) -> PrefillAnswer:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        choices = body.get("choices") if isinstance(body, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(body, dict) or not isinstance(choice, dict):
            raise LegFailed("bad_answer", f"not a completion: {raw[:200]!r}")
        prompt_ids = choice.get("prompt_token_ids") or []
        token_ids = choice.get("token_ids") or []
        text, reason = choice.get("text") or "", choice.get("finish_reason")
        stop, fingerprint = choice.get("stop_reason"), body.get("system_fingerprint")
        usage, kv = body.get("usage"), body.get("kv_transfer_params")
        # the prompt's ids are only counted and passed on to D (which checks them): a list
        if not (isinstance(prompt_ids, list) and _ints(token_ids) and isinstance(text, str)
                and isinstance(reason, str | None)
                and (stop is None or isinstance(stop, str | int))
                and isinstance(fingerprint, str | None) and isinstance(usage, dict | None)
                and isinstance(kv, dict | None)):
            raise LegFailed("bad_answer", f"a completion out of shape: {raw[:200]!r}")
        return cls(list(prompt_ids), text, list(token_ids), reason, stop, fingerprint, usage,
                   body)
