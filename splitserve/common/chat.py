"""What a chat prompt is rendered from besides the request, as router and workers compare it.

A worker advertises how its vLLM renders chats (`WorkerInfo.chat_format` and
`chat_template_sha256`); the router renders a chat itself only when its tokenizer's template
has the same digest, so the token ids it sends P and D are those the workers would compute.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# vLLM's content formats: text parts joined by newlines, or kept as a list of parts
CONTENT_FORMATS = ("string", "openai")


def chat_template_sha256(template: str | None, default_kwargs: Mapping[str, Any]) -> str:
    """One digest of a chat template's text (None: no template) and the template kwargs the
    server adds to every request (vLLM's `--default-chat-template-kwargs`)."""
    blob = json.dumps([template, dict(default_kwargs)], sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()
