"""Joining t1 and D's tokens into the events and bodies a colocated server would send."""

from __future__ import annotations

from typing import Any

from splitserve.router.formats import Joiner, error_body, sse, sse_comment
from splitserve.router.params import plan_legs


def joiner(kind: str, **body: Any) -> Joiner:
    base = ({"prompt": "x"} if kind == "completion"
            else {"messages": [{"role": "user", "content": "x"}]})
    legs = plan_legs({"model": "m", **base, **body}, kind, [1, 2, 3])  # type: ignore[arg-type]
    return Joiner(legs, "rid", "m")


def test_completion_stream_with_usage_counts_every_token_once() -> None:
    j = joiner("completion", stream=True, return_token_ids=True,
               stream_options={"include_usage": True})
    assert j.start([1, 2, 3], "fp") == []
    first = j.tokens("a", [7], None, None)
    assert first["id"] == "cmpl-rid" and first["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    second = j.tokens("b", [8], "length", None)
    assert second["choices"][0]["prompt_token_ids"] is None
    assert "system_fingerprint" not in second  # it goes on the usage chunk
    (usage,) = j.end()
    assert usage["choices"] == [] and usage["system_fingerprint"] == "fp"
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


def test_completion_stream_without_usage_marks_the_last_chunk() -> None:
    j = joiner("completion", stream=True)
    j.start([1, 2, 3], "fp")
    first = j.tokens("a", [7], None, None)
    assert first["choices"][0]["token_ids"] is None and "usage" not in first
    last = j.tokens("", [2], "stop", None)
    assert last["system_fingerprint"] == "fp" and j.end() == []


def test_chat_stream_role_chunk_and_continuous_usage() -> None:
    j = joiner("chat", stream=True,
               stream_options={"include_usage": True, "continuous_usage_stats": True})
    (role,) = j.start([1, 2, 3], "fp")
    assert role["object"] == "chat.completion.chunk" and role["id"] == "chatcmpl-rid"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"]["completion_tokens"] == 0 and role["prompt_token_ids"] is None
    chunk = j.tokens("hi", [9, 10], None, None)  # a chunk may carry several tokens
    assert chunk["usage"]["completion_tokens"] == 2 and "stop_reason" not in chunk["choices"][0]
    end = j.tokens("", [2], "stop", 2)
    assert end["choices"][0]["stop_reason"] == 2 and end["usage"]["total_tokens"] == 6


def test_non_stream_bodies() -> None:
    j = joiner("chat", return_token_ids=True)
    j.start([1, 2, 3], "fp")
    j.tokens("he", [4], None, None)
    j.tokens("llo", [5], "length", None)
    body = j.response()
    assert body["choices"][0]["message"]["content"] == "hello"
    assert body["choices"][0]["token_ids"] == [4, 5] and body["prompt_token_ids"] == [1, 2, 3]
    assert body["usage"]["completion_tokens"] == 2 and body["object"] == "chat.completion"
    c = joiner("completion")
    c.start([1], None)
    c.tokens("x", [4], "stop", None)
    out = c.response()
    assert out["choices"][0]["text"] == "x" and out["choices"][0]["token_ids"] is None


def test_wire_helpers() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse_comment("t", {"x": 1}) == b': t {"x":1}\n\n'
    assert error_body("bad", param="n")["error"] == {
        "message": "bad", "type": "BadRequestError", "param": "n", "code": 400}
