"""The router's text for split requests equals a colocated engine's, also when t1 ends in the
middle of a character (where D's own detokenizer, primed with t1 as prompt, goes wrong)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from transformers import AutoTokenizer

from splitserve.router.detok import text_stream
from splitserve.router.formats import Joiner
from splitserve.router.params import plan_legs


def colocated_texts(backend: tokenizers.Tokenizer, prompt: list[int], out: list[int]
                    ) -> list[str]:
    """What vLLM's FastIncrementalDetokenizer yields on the engine that produced `out`."""
    stream = tokenizers.decoders.DecodeStream(ids=prompt, skip_special_tokens=True)
    return [stream.step(backend, t) or "" for t in out]


@pytest.mark.parametrize("primed_after_t1", [True, False], ids=["primed", "lazy"])
def test_partial_character_at_t1(llama_ckpt: Path, primed_after_t1: bool) -> None:
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    backend = tok._tokenizer
    partial = [i for i in range(6, tok.vocab_size) if "\ufffd" in backend.decode([i])]
    assert partial, "the byte-level vocabulary has tokens that end mid-character"
    prompt = backend.encode("hello there", add_special_tokens=False).ids
    out = [partial[0], 40, partial[1], partial[2], 41]
    want = colocated_texts(backend, prompt, out)
    # D primed with prompt + [t1] gets t2 wrong: the bug the router's text stream exists for
    d_stream = tokenizers.decoders.DecodeStream(ids=prompt + out[:1], skip_special_tokens=True)
    assert (d_stream.step(backend, out[1]) or "") != want[1]

    legs = plan_legs({"model": "m", "prompt": prompt, "stream": True}, "completion", prompt)
    joiner = Joiner(legs, "r", "m")
    joiner.text_stream = text_stream(tok, prompt, {})
    joiner.start(prompt, None)
    got = [joiner.tokens(want[0], out[:1], None, None)["choices"][0]["text"]]
    assert joiner.text_stream is not None and joiner.text_stream.stream is None  # t1: no prime
    if primed_after_t1:  # as the router does once t1 is sent; else the next token primes it
        joiner.text_stream.prime()
    got += [joiner.tokens("D's wrong text", [t], None, None)["choices"][0]["text"]
            for t in out[1:]]
    assert got == want


def test_stop_token_adds_no_text(llama_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    ids = tok._tokenizer.encode("sun moon", add_special_tokens=False).ids
    stream = text_stream(tok, [5, 6], {})
    assert stream is not None and stream.text(ids, "stop") == tok.decode(ids[:-1])
    keep = text_stream(tok, [5, 6], {"include_stop_str_in_output": True})
    assert keep is not None and keep.text(ids, "stop") == tok.decode(ids)
