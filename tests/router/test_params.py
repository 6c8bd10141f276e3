"""Which requests the seeded two-leg flow may carry, and what each leg receives."""

from __future__ import annotations

import pytest

from splitserve.router.params import (
    RequestError,
    check_budget,
    decode_body,
    plan_legs,
    prefill_body,
    unsplittable_reason,
    validate,
)

BASE = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -0.1}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"stop": ["\n"]}, "stop"),
    ({"stop": "end"}, "stop"),
    ({"bad_words": ["x y"]}, "bad_words"),
    ({"seed": 3, "temperature": 0.7}, "seed"),
    ({"logprobs": 2}, "logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"echo": True}, "echo"),
    ({"structured_outputs": {"json": {}}}, "structured_outputs"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": ["a", "b"]}, "prompt"),
])
def test_completion_parameters_the_flow_would_change_are_named(extra: dict, param: str) -> None:
    assert unsplittable_reason(BASE | extra, "completion") == param


@pytest.mark.parametrize("extra", [
    {}, {"n": 1}, {"frequency_penalty": 0}, {"stop": []}, {"seed": 3},  # greedy: seed unused
    {"ignore_eos": True, "return_token_ids": True, "top_k": 5, "logit_bias": {"3": 1.0}},
    {"prompt": [1, 2, 3]}, {"min_tokens": 4}, {"stop_token_ids": [7]},
    {"stream": True, "stream_options": {"include_usage": True}},
])
def test_tokenwise_parameters_split(extra: dict) -> None:
    assert unsplittable_reason(BASE | extra, "completion") is None


def test_chat_parameters() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    assert unsplittable_reason(chat, "chat") is None
    assert unsplittable_reason(chat | {"tool_choice": "none", "logprobs": False}, "chat") is None
    assert unsplittable_reason(chat | {"logprobs": True}, "chat") == "logprobs"
    assert unsplittable_reason(chat | {"tools": [{"type": "function"}]}, "chat") == "tools"
    # a field the router does not know might change meaning: never split it blindly
    assert unsplittable_reason(chat | {"some_new_field": 1}, "chat") == "some_new_field"


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "x", "model": "other"}, "model", 404),
    ({"model": "m"}, "prompt", 400),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", 400),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", 400),
    ({"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params", 400),
    ({"prompt": "x", "stream_options": 3}, "stream_options", 400),
    # vLLM's own check, which P's leg (never streamed) would not make
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", 400),
    # the workers' KV events are the router's cache index: a client does not set how they report
    ({"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "full"}}, "vllm_xargs", 400),
    # numbers beyond float32 (or NaN) would overflow into an engine error: found by the fuzzer
    ({"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty", 400),
    ({"prompt": "x", "temperature": float("nan")}, "temperature", 400),
    ({"prompt": "x", "top_p": float("inf")}, "top_p", 400),
    # integers beyond 64 bits cannot reach the engine (vLLM answered top_k 1.2e25 with a 500)
    ({"prompt": "x", "top_k": 11985488776082688573440000}, "top_k", 400),
    ({"prompt": "x", "stop_token_ids": [1, 2**64]}, "stop_token_ids", 400),
    ({"prompt": "x", "logit_bias": {"5": -(2**63) - 1}}, "logit_bias", 400),
])
def test_validation_names_the_field(body: dict, param: str, status: int) -> None:
    with pytest.raises(RequestError) as err:
        validate(body, "completion", "m")
    assert (err.value.param, err.value.status) == (param, status)


def test_64_bit_integers_pass() -> None:
    body = {"prompt": [2**63], "top_k": 2**63 - 1, "seed": -(2**63), "stop_token_ids": [7]}
    assert validate(body, "completion", "m") is body  # the prompt is the workers' to check


def test_chat_needs_messages() -> None:
    with pytest.raises(RequestError) as err:
        validate({"messages": []}, "chat", "m")
    assert err.value.param == "messages"


def test_leg_bodies_split_the_budget_exactly() -> None:
    body = BASE | {"max_tokens": 8, "min_tokens": 3, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}, "return_token_ids": False,
                   "truncate_prompt_tokens": 50}
    legs = plan_legs(body, "completion", "hi")
    kv = {"do_remote_decode": True, "transfer_id": "t"}
    p = prefill_body(legs, "m", kv)
    assert p["max_tokens"] == 1 and p["min_tokens"] == 1 and p["stream"] is False
    assert p["return_token_ids"] is True and p["ignore_eos"] is True
    assert p["kv_transfer_params"] == kv and "stream_options" not in p
    d = decode_body(legs, "m", [5, 6], [9], {"do_remote_prefill": True, "transfer_id": "t"})
    assert d["prompt"] == [5, 6, 9] and d["max_tokens"] == 7 and d["min_tokens"] == 2
    assert d["stream"] is True and d["kv_transfer_params"]["transfer_id"] == "t"
    # P truncates the prompt; D must not truncate P's ids + t1 a second time
    assert p["truncate_prompt_tokens"] == 50 and "truncate_prompt_tokens" not in d
    # resuming after three tokens: the rest of the budget, and no KV from elsewhere
    d2 = decode_body(legs, "m", [5, 6], [9, 10, 11], None)
    assert d2["prompt"] == [5, 6, 9, 10, 11] and d2["max_tokens"] == 5
    assert d2["min_tokens"] == 0 and "kv_transfer_params" not in d2


def test_a_budget_left_out_is_vllms_default_of_its_kind_on_d() -> None:
    """D's leg is a completion, whose own default budget (and null) is 16: it is always sent a
    number. A completion without max_tokens, or with null, has 16 in all (t1 and 15 on D); a
    chat request without one runs to the end of the context, which D is told outright."""
    for body in ({"model": "m", "prompt": "x"}, {"model": "m", "prompt": "x", "max_tokens": None}):
        legs = plan_legs(body, "completion", "x", max_model_len=100)
        assert legs.max_tokens == 16
        assert decode_body(legs, "m", [1], [2], None)["max_tokens"] == 15
    # vLLM's completions know no max_completion_tokens: it is ignored there, as by vLLM
    body = {"model": "m", "prompt": "x", "max_completion_tokens": 5}
    assert plan_legs(body, "completion", "x").max_tokens == 16
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    legs = plan_legs(chat, "chat", [1, 2, 3], max_model_len=100)
    assert legs.max_tokens is None
    assert decode_body(legs, "m", [1, 2, 3], [4], None)["max_tokens"] == 96
    assert decode_body(legs, "m", [1, 2, 3], [4, 5, 6], None, replayed=1)["max_tokens"] == 95
    assert "max_tokens" not in decode_body(plan_legs(chat, "chat", [1]), "m", [1], [2], None)
    # a model whose generation config sets max_new_tokens: vLLM caps such a chat request at it
    legs = plan_legs(chat, "chat", [1, 2, 3], max_model_len=100, chat_max_tokens=20)
    assert decode_body(legs, "m", [1, 2, 3], [4], None)["max_tokens"] == 19
    check_budget(chat, plan_legs(chat, "chat", [1], max_model_len=100, chat_max_tokens=200))


def test_chat_legs_carry_only_tokenwise_fields() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5, "temperature": 0.0, "top_p": 0.9, "user": "u",
            "add_generation_prompt": True}
    legs = plan_legs(body, "chat", [1, 2, 3])
    p = prefill_body(legs, "m", None)
    assert p["prompt"] == [1, 2, 3] and "messages" not in p and "add_generation_prompt" not in p
    assert p["top_p"] == 0.9 and legs.max_tokens == 5


def test_a_budget_beyond_the_context_is_refused_before_any_token() -> None:
    """vLLM refuses max_tokens > max_model_len up front; split, only D would see the budget,
    after t1 went out. Within the context, both legs clamp alike: no refusal."""
    body = {"model": "m", "prompt": "x", "max_tokens": 4097}
    with pytest.raises(RequestError, match="max_tokens=4097 cannot be greater than "
                                           "max_model_len=4096") as err:
        check_budget(body, plan_legs(body, "completion", "x", 4096))
    assert err.value.param == "max_tokens" and err.value.status == 400
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5000}
    with pytest.raises(RequestError) as err:
        check_budget(body, plan_legs(body, "chat", [1], 4096))
    assert err.value.param == "max_completion_tokens"
    for budget, limit in ((4096, 4096), (None, 4096), (10**6, None)):
        body = {"prompt": "x", "max_tokens": budget}
        check_budget(body, plan_legs(body, "completion", "x", limit))


def test_continuous_usage_needs_include_usage_as_in_vllm() -> None:
    opts = {"continuous_usage_stats": True}
    assert not plan_legs({"prompt": "x", "stream": True, "stream_options": opts},
                         "completion", "x").continuous_usage
    assert plan_legs({"prompt": "x", "stream": True,
                      "stream_options": opts | {"include_usage": True}},
                     "completion", "x").continuous_usage
