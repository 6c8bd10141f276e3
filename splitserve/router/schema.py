"""Request bodies of the router's OpenAI endpoints as OpenAPI (JSON Schema), for `/openapi.json`.

The handlers read the raw body themselves (`params.validate` checks what the router relies on;
vLLM validates the rest on the legs), so these schemas document the API and drive the fuzz
tests; they are not a second validator. They list the OpenAI fields and the vLLM extensions the
router passes through; `additionalProperties` stays open because vLLM accepts more.
"""

from __future__ import annotations

from typing import Any

_INT_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                   {"type": "null"}]}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# Sampling and output fields shared by both endpoints.
SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": -1}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "n": _nullable({"type": "integer", "minimum": 1}),
    "seed": _nullable({"type": "integer"}),
    "stop": _STOP,
    "stop_token_ids": _nullable(_INT_ARRAY),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {
        "include_usage": {"type": "boolean"},
        "continuous_usage_stats": {"type": "boolean"}}}),
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "return_token_ids": _nullable({"type": "boolean"}),
    "skip_special_tokens": {"type": "boolean"},
    "user": _nullable({"type": "string"}),
}

COMPLETION_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": SAMPLING | {
        "prompt": {"anyOf": [{"type": "string"}, _INT_ARRAY,
                             {"type": "array", "items": {"type": "string"}}]},
        "logprobs": _nullable({"type": "integer", "minimum": 0}),
        "echo": _nullable({"type": "boolean"}),
        "suffix": _nullable({"type": "string"}),
    },
}

MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {"type": "string"},
    },
}

CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": SAMPLING | {
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"},
    },
}

ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": _nullable({"type": "string"}), "code": {}}}},
}


def openapi_body(schema: dict[str, Any], summary: str) -> dict[str, Any]:
    """`openapi_extra` for a route whose handler reads the raw body itself."""
    error = {"content": {"application/json": {"schema": ERROR}}}
    return {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": {"description": "the completion (JSON), or a server-sent event stream when "
                                   "`stream` is true",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "invalid request", **error},
            "401": {"description": "missing or wrong API key", **error},
            "404": {"description": "unknown model", **error},
            "413": {"description": "request body too large", **error},
            "429": {"description": "over capacity; retry after `Retry-After` s", **error},
        },
    }
