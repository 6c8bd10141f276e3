"""The prompt side of the router: the model's tokenizer and chat template, and KV size per token."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from splitserve.common.chat import chat_template_sha256
from splitserve.common.modelconfig import kv_shape, read_config
from splitserve.common.wire import WorkerInfo
from splitserve.router.params import ENGINE_TOKENIZES, RequestError


def kv_bytes_per_token(model_dir: str | None) -> int:
    """KV bytes of one prompt token at 4 bytes an element (float32: an upper bound), K and V
    of every KV head or MLA's one latent (`common.modelconfig.kv_shape`); 0 if unknown."""
    if not model_dir:
        return 0
    try:
        return kv_shape(read_config(model_dir)).elements_per_token * 4
    except (OSError, KeyError, ValueError, TypeError):
        return 0


def chat_default_max_tokens(model_dir: str | None) -> int | None:
    """The budget vLLM gives a chat request without one, beyond the rest of the context: the
    model's `generation_config.json` `max_new_tokens` (vLLM's `--generation-config auto`, its
    default); None when it sets none."""
    try:
        config = json.loads((Path(model_dir or "") / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_new_tokens") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def load_tokenizer(model_dir: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir) if model_dir else None


# Messages the router renders itself: text from these roles, and a name. Anything else (tool
# calls and results, a developer role, images, reasoning) vLLM rewrites before its template
# sees it, so such a request runs whole on one worker.
PLAIN_ROLES = frozenset({"system", "user", "assistant"})
PLAIN_KEYS = frozenset({"role", "content", "name"})
# vLLM drops a system text that starts with this (Claude Code's per-request attribution line).
BILLING_HEADER = "x-anthropic-billing-header"


# `workers_chat_format` when the router cannot render the workers' chats
OTHER_TEMPLATE = "other-template"


def own_chat_template_sha256(tokenizer: Any) -> str | None:
    """The digest (`common.chat`) of what the router renders chats from: its tokenizer's
    default template and no default kwargs; None without a tokenizer."""
    if tokenizer is None:
        return None
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):  # no template: rendering a chat raises
        template = None
    return chat_template_sha256(template if isinstance(template, str) else None, {})


def workers_chat_format(infos: Iterable[WorkerInfo | None], own_sha256: str | None
                        ) -> str | None:
    """How the workers in `infos` give message content to their chat template, as they
    advertise it ("string" | "openai"); `OTHER_TEMPLATE` when one renders from another
    template or other default kwargs than the router (`own_sha256`), or two disagree: their
    chats run whole. None when none advertises it: strings are rendered as they are."""
    seen = {(i.chat_format, i.chat_template_sha256) for i in infos
            if i is not None and i.chat_format is not None}
    if not seen:
        return None
    if len(seen) > 1:
        return OTHER_TEMPLATE
    ((fmt, sha),) = seen
    return fmt if sha == own_sha256 else OTHER_TEMPLATE


def plain_conversation(messages: Any, fmt: str | None) -> list[dict[str, Any]] | None:
    """`messages` as vLLM gives them to a chat template of content format `fmt`, or None when
    the router cannot render them exactly as vLLM would (see `PLAIN_ROLES`; a list of text
    parts also needs the format known; none under `OTHER_TEMPLATE`). vLLM makes every content
    a list of text parts, then for "string" joins the non-empty ones with newlines and for
    "openai" keeps them all."""
    if fmt == OTHER_TEMPLATE:
        return None
    out: list[dict[str, Any]] = []
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in PLAIN_ROLES and set(m) <= PLAIN_KEYS
                and isinstance(m.get("name", ""), str)):
            return None
        content = m.get("content")
        if isinstance(content, str):
            texts = [content]
        elif isinstance(content, list) and fmt is not None and all(
                isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
                and isinstance(p["text"], str) for p in content):
            texts = [p["text"] for p in content]
        else:
            return None
        if m["role"] == "system" and any(t.startswith(BILLING_HEADER) for t in texts):
            return None
        msg = dict(m)
        if fmt == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        elif isinstance(content, list):
            msg["content"] = "\n".join(t for t in texts if t)
        out.append(msg)
    return out


def render_chat(tokenizer: Any, body: dict[str, Any], messages: list[dict[str, Any]] | None
                ) -> list[int]:
    """The chat prompt as token ids, rendered once with the model's chat template from
    `messages`: `body`'s messages as vLLM gives them to the workers' template
    (`plain_conversation`; None: the router cannot render them, a RequestError)."""
    if tokenizer is None:
        raise RequestError("chat needs the model's tokenizer; start the router with --model",
                           "messages")
    if messages is None:
        raise RequestError("these messages are rendered by the worker, not the router",
                           "messages")
    kwargs = dict(body.get("chat_template_kwargs") or {})
    try:
        ids = tokenizer.apply_chat_template(
            messages, tokenize=True,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False), **kwargs)
    except Exception as exc:  # the template is user-supplied code: report, don't crash
        raise RequestError(f"cannot apply the chat template: {exc}", "messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def prompt_chars_limit(tokenizer: Any, max_model_len: int | None) -> int | None:
    """The longest string prompt the router tokenizes: vLLM's own bound before it tokenizes
    (`max_model_len` x the vocabulary's longest token, in characters); None: no bound known."""
    if tokenizer is None or not max_model_len:
        return None
    try:
        longest = max(len(tok) for tok in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None
    return max_model_len * longest


def completion_prompt(tokenizer: Any, body: dict[str, Any], chars_limit: int | None = None
                      ) -> str | list[int]:
    """What P is sent for a completion request: a string prompt as the token ids vLLM makes of
    it (the model's tokenizer, `add_special_tokens` from the request, default True), so the
    router routes by the ids P computes on and P's `prompt_token_ids` equal them.

    The string itself (vLLM tokenizes it, as before) when the router has no tokenizer, when the
    request sets a field in `ENGINE_TOKENIZES`, when `add_special_tokens` is not a boolean (vLLM
    answers 400), or when the string is longer than `chars_limit` (vLLM refuses it before
    tokenizing; the router does not spend its loop on it). Token-id prompts pass unchanged."""
    prompt = body["prompt"]
    special = body.get("add_special_tokens", True)
    if (tokenizer is None or not isinstance(prompt, str) or not isinstance(special, bool)
            or any(body.get(k) is not None for k in ENGINE_TOKENIZES)
            or (chars_limit is not None and len(prompt) > chars_limit)):
        return prompt
    return [int(i) for i in tokenizer(prompt, add_special_tokens=special)["input_ids"]]
