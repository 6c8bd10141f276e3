"""A worker advertises how its vLLM renders chats, from vLLM's own resolution of its flags; the
router renders a chat itself only when the digest equals its own."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from splitserve.common.chat import chat_template_sha256
from splitserve.router.prompt import own_chat_template_sha256
from splitserve.worker.chat_rendering import chat_rendering

PARTS_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}"
                  "{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def engine(llama_ckpt: Path) -> Any:
    """What the plugin reads of vLLM's engine client: its model config and renderer."""
    from vllm.config import ModelConfig
    from vllm.tokenizers.registry import get_tokenizer

    tokenizer = get_tokenizer(str(llama_ckpt))
    return SimpleNamespace(model_config=ModelConfig(model=str(llama_ckpt), dtype="float32"),
                           renderer=SimpleNamespace(get_tokenizer=lambda: tokenizer))


def flags(**given: Any) -> Namespace:
    """vLLM's defaults (`cohere_format` among them), then `given`."""
    return Namespace(**{"chat_template": None, "chat_template_content_format": "auto",
                        "default_chat_template_kwargs": None, "cohere_format": "cmd4",
                        **given})


def test_a_worker_on_the_models_template_renders_as_the_router(engine: Any,
                                                               llama_ckpt: Path) -> None:
    rendering = chat_rendering(engine, flags())
    assert rendering.content_format == "string"  # the template prints m['content'] whole
    own = own_chat_template_sha256(AutoTokenizer.from_pretrained(str(llama_ckpt)))
    assert rendering.template_sha256 == own


def test_each_flag_that_changes_the_rendering_changes_what_it_advertises(
        engine: Any, tmp_path: Path) -> None:
    default = chat_rendering(engine, flags())
    # a template given as a file: vLLM's reading of it (a loop over the parts)
    (tmp_path / "parts.jinja").write_text(PARTS_TEMPLATE)
    given = chat_rendering(engine, flags(chat_template=str(tmp_path / "parts.jinja")))
    assert given.content_format == "openai"
    assert given.template_sha256 == chat_template_sha256(PARTS_TEMPLATE, {})
    # the format forced on the model's own template
    forced = chat_rendering(engine, flags(chat_template_content_format="openai"))
    assert (forced.content_format, forced.template_sha256) == ("openai",
                                                               default.template_sha256)
    # kwargs vLLM adds to every request: those the template reads count, others reach nothing
    uses = "{{ brief }}" + PARTS_TEMPLATE
    (tmp_path / "uses.jinja").write_text(uses)
    kwargs = chat_rendering(engine, flags(chat_template=str(tmp_path / "uses.jinja"),
                                          default_chat_template_kwargs={"brief": 1, "x": 2}))
    assert kwargs.template_sha256 == chat_template_sha256(uses, {"brief": 1})
    unread = chat_rendering(engine, flags(default_chat_template_kwargs={"brief": 1}))
    assert unread.template_sha256 == default.template_sha256
