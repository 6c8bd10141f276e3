"""The router tokenizes a string completion prompt exactly as vLLM does, and sends the ids on;
it leaves to the engine what it cannot reproduce."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from splitserve.common.chat import chat_template_sha256
from splitserve.common.vocab import Connector, Role
from splitserve.common.wire import WorkerInfo
from splitserve.router.prompt import (
    OTHER_TEMPLATE,
    chat_default_max_tokens,
    completion_prompt,
    own_chat_template_sha256,
    plain_conversation,
    prompt_chars_limit,
    workers_chat_format,
)

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé and   spaces\n"


def test_string_prompts_become_the_engines_own_ids(llama_ckpt: Path) -> None:
    from vllm.renderers.params import TokenizeParams
    from vllm.tokenizers.registry import get_tokenizer

    ours = AutoTokenizer.from_pretrained(str(llama_ckpt))
    engine = get_tokenizer(str(llama_ckpt))  # as vLLM loads it (truncation side: left)
    for special in (True, False):
        body = {"prompt": TEXT, "add_special_tokens": special}
        params = TokenizeParams(max_total_tokens=2048, max_output_tokens=16,
                                add_special_tokens=special)
        want = engine(TEXT, **params.get_encode_kwargs())["input_ids"]
        assert completion_prompt(ours, body) == want
    assert completion_prompt(ours, {"prompt": TEXT}) == ours(TEXT)["input_ids"]  # default on


def test_the_engine_tokenizes_what_the_router_cannot_reproduce(llama_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    assert completion_prompt(None, {"prompt": TEXT}) == TEXT  # no tokenizer: as before
    for extra in ({"truncate_prompt_tokens": 4}, {"truncation_side": "left"},
                  {"add_special_tokens": "yes"}):
        assert completion_prompt(tok, {"prompt": TEXT} | extra) == TEXT
    assert completion_prompt(tok, {"prompt": [1, 2, 3]}) == [1, 2, 3]
    limit = prompt_chars_limit(tok, 8)
    assert limit is not None and limit >= 8
    assert completion_prompt(tok, {"prompt": "x" * (limit + 1)}, limit) == "x" * (limit + 1)
    assert prompt_chars_limit(tok, None) is None and prompt_chars_limit(None, 8) is None


def test_messages_reach_the_template_as_vllm_gives_them() -> None:
    """vLLM makes every content a list of text parts, then joins the non-empty ones with
    newlines for a "string" template and keeps them all for an "openai" one; the router does
    the same, and declines (None: the request runs whole) what vLLM rewrites further."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
             {"type": "text", "text": "b"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": parts, "name": "u"}]
    assert plain_conversation(msgs, "string") == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a\nb", "name": "u"}]
    assert plain_conversation(msgs, "openai") == [
        {"role": "system", "content": [{"type": "text", "text": "s"}]},
        {"role": "user", "content": parts, "name": "u"}]
    assert plain_conversation([{"role": "user", "content": "x"}], None) == [
        {"role": "user", "content": "x"}]
    for declined, fmt in (
            ([{"role": "user", "content": parts}], None),  # the format is not known
            ([{"role": "tool", "content": "r", "tool_call_id": "1"}], "string"),
            ([{"role": "developer", "content": "d"}], "string"),
            ([{"role": "assistant", "content": None, "tool_calls": []}], "string"),
            ([{"role": "assistant", "content": "x", "reasoning": "r"}], "string"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
             "openai"),
            ([{"role": "system", "content": "x-anthropic-billing-header: cch=1\nhi"}], "string"),
            ([{"role": "user", "content": "x", "name": 3}], "string"),
            (["hello"], "string")):
        assert plain_conversation(declined, fmt) is None, declined


def test_the_router_renders_chats_only_from_the_workers_template(llama_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    own = own_chat_template_sha256(tok)
    assert own == chat_template_sha256(tok.chat_template, {})
    assert own_chat_template_sha256(None) is None

    def info(fmt: str | None, sha: str | None) -> WorkerInfo:
        return WorkerInfo(Connector.SPLITSERVE, Role.PREFILL, chat_format=fmt,
                          chat_template_sha256=sha)

    assert workers_chat_format([info("openai", own), info("openai", own), None], own) == "openai"
    assert workers_chat_format([info("string", own), info(None, None)], own) == "string"
    assert workers_chat_format([info(None, None), None], own) is None  # none advertises it
    for infos in ([info("string", own), info("openai", own)],  # a worker's flag differs
                  [info("string", own), info("string", "f" * 64)],  # another template
                  [info("string", chat_template_sha256(tok.chat_template, {"x": 1}))]):
        assert workers_chat_format(infos, own) == OTHER_TEMPLATE
    assert plain_conversation([{"role": "user", "content": "x"}], OTHER_TEMPLATE) is None
    # no template on either side: the same digest (the router then answers vLLM's 400)
    tok.chat_template = None
    assert own_chat_template_sha256(tok) == chat_template_sha256(None, {})


def test_a_chats_default_budget_is_the_generation_configs(tmp_path: Path) -> None:
    assert chat_default_max_tokens(str(tmp_path)) is None  # no generation config
    for text, want in (('{"max_new_tokens": 512, "temperature": 0.7}', 512),
                       ('{"temperature": 0.7}', None), ('{"max_new_tokens": true}', None),
                       ("not json", None)):
        (tmp_path / "generation_config.json").write_text(text)
        assert chat_default_max_tokens(str(tmp_path)) == want, text
    assert chat_default_max_tokens(None) is None
