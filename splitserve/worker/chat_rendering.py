"""How this worker's vLLM renders a chat, for `/splitserve/info` (`common.chat`).

Computed once in the API server, from what vLLM itself uses: the template it resolves for a
request without tools (`--chat-template`, else the processor's, the tokenizer's or vLLM's
fallback), the content format it gives that template (`--chat-template-content-format`, else
its own reading of the template) and the `--default-chat-template-kwargs` it passes on.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from splitserve.common.chat import chat_template_sha256


@dataclass(frozen=True)
class ChatRendering:
    content_format: str  # "string" | "openai"
    template_sha256: str


def chat_rendering(engine_client: Any, args: Namespace) -> ChatRendering:
    """The rendering of the server started with `args` on `engine_client` (pinned: vLLM
    0.32's `renderers.hf` and `launchers.cli_args`; raises whatever they raise)."""
    from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.hf import (
        resolve_chat_template,
        resolve_chat_template_content_format,
        resolve_chat_template_kwargs,
    )

    model_config = engine_client.model_config
    tokenizer = engine_client.renderer.get_tokenizer()
    given = load_chat_template(getattr(args, "chat_template", None))
    template = resolve_chat_template(tokenizer, given, None, model_config=model_config)
    fmt = resolve_chat_template_content_format(
        given, None, getattr(args, "chat_template_content_format", "auto"), tokenizer,
        model_config=model_config)
    if not isinstance(template, str):
        return ChatRendering(str(fmt), chat_template_sha256(None, {}))
    # the defaults vLLM passes on: those the template or HF's apply_chat_template takes (its
    # own default `cohere_format` reaches no other template)
    defaults = resolve_chat_template_kwargs(
        tokenizer, template, resolve_default_chat_template_kwargs(args),
        raise_on_unexpected=False)
    return ChatRendering(str(fmt), chat_template_sha256(template, defaults))
