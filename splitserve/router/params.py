"""Request validation and the bodies of the two legs.

Invariant: a request goes through the seeded flow (P samples t1, D continues from prompt + [t1])
only if every parameter it carries means exactly the same there as on one colocated worker.
Anything else is named by `unsplittable_reason` and is either run whole on one worker or refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["completion", "chat"]


class RequestError(Exception):
    """A client error: becomes an OpenAI-style error body with this status and parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type


# Sampling fields that mean the same for every token, so they apply unchanged to both legs.
TOKENWISE_FIELDS: frozenset[str] = frozenset({
    "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "logit_bias",
    "allowed_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "priority", "user", "truncate_prompt_tokens",
    "add_special_tokens", "cache_salt", "return_token_ids", "vllm_xargs",
})
# Request fields that change how vLLM tokenizes a string prompt beyond `add_special_tokens`:
# with either, vLLM truncates inside the tokenizer call (its special tokens survive), which
# slicing ids would not reproduce, so the engine tokenizes such a prompt itself. An id prompt
# it truncates as well, so P computes on ids the router does not have.
ENGINE_TOKENIZES = ("truncate_prompt_tokens", "truncation_side")
# Fields the router itself consumes or rewrites.
ROUTER_FIELDS: frozenset[str] = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "min_tokens", "n", "kv_transfer_params", "request_id",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
})
# Chat fields that only shape the prompt or the response format, with neutral values.
NEUTRAL_CHAT_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True),
    "response_format": (None, {"type": "text"}), "logprobs": (None, False),
    "top_logprobs": (None, 0), "echo": (None, False), "documents": (None, []),
    "chat_template": (None,), "mm_processor_kwargs": (None, {}), "store": (None, False),
    "metadata": (None,), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "include_reasoning": (None, True),
}
# Completion fields with neutral values.
NEUTRAL_COMPLETION_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None,), "echo": (None, False), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}


def _is_neutral(body: dict[str, Any], field: str, neutral: tuple[Any, ...]) -> bool:
    return field not in body or body[field] in neutral


def unsplittable_reason(body: dict[str, Any], kind: Kind) -> str | None:
    """The first parameter whose meaning the seeded flow would change, or None."""
    n = body.get("n")
    if n not in (None, 1):
        return "n"
    if body.get("best_of") not in (None, 1):
        return "best_of"
    if body.get("use_beam_search"):
        return "use_beam_search"
    # Penalties count output tokens: t1 would move from output to prompt on D.
    if body.get("frequency_penalty") not in (None, 0, 0.0):
        return "frequency_penalty"
    if body.get("presence_penalty") not in (None, 0, 0.0):
        return "presence_penalty"
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        return "repetition_penalty"
    # A stop string may span t1 and t2; multi-token bad words likewise.
    if body.get("stop") not in (None, "", []):
        return "stop"
    if body.get("bad_words") not in (None, []):
        return "bad_words"
    # The seed's random stream would restart at t2 on D.
    if body.get("seed") is not None and body.get("temperature", 1.0) not in (0, 0.0):
        return "seed"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("detokenize") is False:
        return "detokenize"
    for field in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "guided_decoding_backend", "logits_processors",
                  "return_tokens_as_token_ids", "thinking_token_budget"):
        if body.get(field) not in (None, [], {}):
            return field
    neutral = NEUTRAL_CHAT_VALUES if kind == "chat" else NEUTRAL_COMPLETION_VALUES
    for field, values in neutral.items():
        if not _is_neutral(body, field, values):
            return field
    if kind == "completion":
        prompt = body.get("prompt")
        is_tokens = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) or is_tokens):
            return "prompt"
    if kind == "chat":
        known = TOKENWISE_FIELDS | ROUTER_FIELDS | set(NEUTRAL_CHAT_VALUES) | {
            "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "seed",
            "bad_words", "best_of", "use_beam_search", "prompt_logprobs"}
        for field in body:
            if field not in known:
                return field
    return None


def validate(body: Any, kind: Kind, served_model: str) -> dict[str, Any]:
    """Check what the router relies on; vLLM validates the rest on the legs."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")
    if kind == "completion" and "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("messages must be a non-empty list", "messages")
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise RequestError(f"{field} must be at least 1, got {value}.", field)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and (not isinstance(min_tokens, int) or min_tokens < 0):
        raise RequestError(f"min_tokens must be a non-negative integer, got {min_tokens}",
                           "min_tokens")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    if stream_options and not body.get("stream"):  # vLLM's own check: P's leg never streams
        raise RequestError("Stream options can only be defined when `stream=True`.",
                           "stream_options")
    if "kv_transfer_params" in body:
        raise RequestError("kv_transfer_params is set by the router", "kv_transfer_params")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        # the workers' KV events are the router's index of their caches: a client's report
        # mode would re-announce cache hits as stores there
        raise RequestError("vllm_xargs.kv_cache_report_mode is set by the deployment",
                           "vllm_xargs")
    for field in FLOAT_FIELDS:
        value = body.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool) and not (
                abs(value) <= FLOAT32_MAX):  # also NaN, which Python's JSON parser accepts
            raise RequestError(f"{field} must be a finite number, got {value}", field)
    for field, value in body.items():
        if field not in ("prompt", "messages") and beyond_int64(value):
            raise RequestError(f"{field} holds an integer beyond 64 bits", field)
    return body


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def beyond_int64(value: Any) -> bool:
    """An integer the engine cannot carry (its messages are msgspec: 64-bit integers): vLLM
    answers such a `top_k` with a 500. Looks into lists (token id lists) and dict values
    (`logit_bias`). Prompts and messages are the workers' to check (out of vocabulary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return not INT64_MIN <= value <= INT64_MAX
    if isinstance(value, list):
        return any(beyond_int64(v) for v in value)
    if isinstance(value, dict):
        return any(beyond_int64(v) for v in value.values())
    return False


# Sampling numbers the engine holds as float32: anything beyond its range (or NaN, or infinity)
# overflows there into NaN logits, an engine error rather than a clear 400.
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "length_penalty")
FLOAT32_MAX = 3.4028234663852886e38


# vLLM's budget of a completion request whose `max_tokens` is left out or null (a chat
# request's is the rest of the context). D's leg is a completion: it is always sent a number.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def max_tokens_of(body: dict[str, Any], kind: Kind = "chat") -> int | None:
    """The request's budget as vLLM reads it; None: the rest of the context (a chat request
    without one)."""
    if kind == "completion":  # vLLM's completions know no max_completion_tokens
        value = body.get("max_tokens")
        return COMPLETION_DEFAULT_MAX_TOKENS if value is None else value
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


@dataclass(frozen=True)
class Legs:
    """What the two legs need from one client request (chat already rendered to token ids)."""

    kind: Kind
    prompt: str | list[int]  # what P receives; D always receives P's prompt_token_ids + [t1]
    max_tokens: int | None
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    tokenwise: dict[str, Any]  # fields copied unchanged into both legs
    max_model_len: int | None = None  # the workers' context, for a budget of the rest of it

    @property
    def indexed_ids(self) -> list[int] | None:
        """P's prompt ids as the router's cache index keys them, or None: a string prompt;
        ids the engine truncates (`ENGINE_TOKENIZES`); a `cache_salt`, which vLLM hashes
        into the prompt's blocks, where the index keys the ids alone; or an id the index
        cannot key (outside int64: the worker refuses such a prompt with a 400)."""
        if not isinstance(self.prompt, list) or any(
                self.tokenwise.get(k) is not None for k in (*ENGINE_TOKENIZES, "cache_salt")):
            return None
        if self.prompt and not (-(2**63) <= min(self.prompt) and max(self.prompt) < 2**63):
            return None
        return self.prompt


def plan_legs(body: dict[str, Any], kind: Kind, prompt: str | list[int],
              max_model_len: int | None = None, chat_max_tokens: int | None = None) -> Legs:
    """The legs of one request. `max_model_len`: the workers' context; `chat_max_tokens`: the
    budget vLLM gives a chat request without one (its model's generation config), if any."""
    opts = body.get("stream_options") or {}
    stream = bool(body.get("stream"))
    if kind == "completion":
        tokenwise = {k: copy.deepcopy(v) for k, v in body.items()
                     if k not in ROUTER_FIELDS and k not in NEUTRAL_COMPLETION_VALUES}
    else:
        tokenwise = {k: copy.deepcopy(v) for k, v in body.items() if k in TOKENWISE_FIELDS}
    tokenwise.pop("return_token_ids", None)
    budget = max_tokens_of(body, kind)
    return Legs(
        kind=kind, prompt=prompt, max_tokens=chat_max_tokens if budget is None else budget,
        min_tokens=int(body.get("min_tokens") or 0), stream=stream,
        include_usage=stream and bool(opts.get("include_usage")),
        continuous_usage=stream and bool(opts.get("include_usage"))
        and bool(opts.get("continuous_usage_stats")),  # vLLM's: only with include_usage
        return_token_ids=bool(body.get("return_token_ids")), tokenwise=tokenwise,
        max_model_len=max_model_len,
    )


def prefill_body(legs: Legs, model: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    """P: the prompt, one token. min_tokens >= 1 keeps EOS from ending t1, as it would."""
    body = dict(legs.tokenwise)
    body.update(model=model, prompt=legs.prompt, max_tokens=1, stream=False,
                return_token_ids=True, min_tokens=min(legs.min_tokens, 1))
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def decode_body(legs: Legs, model: str, prompt_ids: list[int], produced: list[int],
                kv: dict[str, Any] | None, replayed: int = 0) -> dict[str, Any]:
    """D: prompt + the tokens produced so far, the rest of the budget: for a request without
    one (chat), the rest of the context as a number, since D's leg is a completion, whose
    default (and null) is 16. Always streams and always returns token ids, so the router can
    count tokens and resume elsewhere without loss.
    `replayed`: the last tokens of `produced` left out of the prompt, for D to generate again
    (they count toward D's budget)."""
    body = dict(legs.tokenwise)
    body.pop("truncate_prompt_tokens", None)  # P already truncated; D's prompt is P's ids
    if not 0 <= replayed <= len(produced):
        raise ValueError(f"replayed must be within the {len(produced)} tokens produced")
    kept = len(produced) - replayed
    remaining = legs.max_tokens
    if remaining is None and legs.max_model_len:  # vLLM's chat default, said outright
        remaining = max(legs.max_model_len - len(prompt_ids) - kept, 1)
    elif remaining is not None:
        remaining -= kept
    body.update(model=model, prompt=prompt_ids + produced[:kept], max_tokens=remaining,
                stream=True, return_token_ids=True, min_tokens=max(legs.min_tokens - kept, 0),
                stream_options={"include_usage": True})
    if remaining is None:  # the context is not known: D's own default
        body.pop("max_tokens")
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def check_budget(body: dict[str, Any], legs: Legs) -> None:
    """RequestError for a budget beyond the context, as vLLM answers it before any token. The
    split must refuse it itself: P's leg asks for one token, so only D would refuse it, after
    t1 went to the client. A budget within the context is clamped by vLLM on both legs alike."""
    limit, asked = legs.max_model_len, max_tokens_of(body, legs.kind)
    if asked is None or not limit or asked <= limit:
        return
    field = "max_completion_tokens" if legs.kind == "chat" and body.get(
        "max_completion_tokens") is not None else "max_tokens"
    raise RequestError(f"{field}={asked} cannot be greater than max_model_len="
                       f"{limit}. Please request fewer output tokens.", field)
