"""The router tokenizes a string completion prompt exactly as vLLM does, and sends the ids on;
it leaves to the engine what it cannot reproduce."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from splitserve.router.prompt import completion_prompt, prompt_chars_limit

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
