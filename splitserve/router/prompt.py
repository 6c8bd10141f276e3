"""The prompt side of the router: the model's tokenizer and chat template, and KV size per token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitserve.router.params import RequestError


def kv_bytes_per_token(model_dir: str | None) -> int:
    """2 x layers x KV heads x head_dim x 4 bytes (float32: an upper bound), 0 if unknown."""
    try:
        cfg = json.loads((Path(model_dir or "") / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 4
    except (OSError, KeyError, ValueError, TypeError):
        return 0


def load_tokenizer(model_dir: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir) if model_dir else None


def render_chat(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The chat prompt as token ids, rendered once with the model's chat template."""
    if tokenizer is None:
        raise RequestError("chat needs the model's tokenizer; start the router with --model",
                           "messages")
    kwargs = dict(body.get("chat_template_kwargs") or {})
    try:
        ids = tokenizer.apply_chat_template(
            body["messages"], tokenize=True,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False), **kwargs)
    except Exception as exc:  # the template is user-supplied code: report, don't crash
        raise RequestError(f"cannot apply the chat template: {exc}", "messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
