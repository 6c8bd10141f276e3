"""Fuzz: schemathesis against the router's own OpenAPI schema, valid and invalid bodies.

The router serves a split pool (the session's P/D pair) and a colocated worker, so generated
requests take every path: split, whole (unsplittable parameters) and refused. Whatever comes in,
the answer is never a 5xx and never a hang, and the workers end with nothing allocated.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.support.routers import Router, start_router
from tests.support.workers import Worker

MAX_TOKENS = 4  # keeps every generated request short
PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def fuzz_router(llama_pair: tuple[Worker, Worker], colocated_worker: Worker,
                router_logs: Path) -> Iterator[Router]:
    p, d = llama_pair
    r = start_router(router_logs, "--prefill", p.url, "--decode", d.url,
                     "--colocated", colocated_worker.url)
    yield r
    r.stop()


def bounded(schema: dict[str, Any], model: str) -> dict[str, Any]:
    """The router's schema with sizes capped so that valid cases stay cheap to serve."""
    out = copy.deepcopy(schema)
    for path in PATHS:
        body = out["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        props = body["schema"]["properties"]
        props["model"] = {"type": "string", "enum": [model]}
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if name in props:
                props[name] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        if "prompt" in props:
            props["prompt"] = {"anyOf": [
                {"type": "string", "maxLength": 64},
                {"type": "array", "maxItems": 64,
                 "items": {"type": "integer", "minimum": 0, "maximum": 1100}}]}
        if "messages" in props:
            props["messages"]["maxItems"] = 3
            props["messages"]["items"]["properties"]["content"]["maxLength"] = 64
    return out


def clamp(body: Any) -> None:
    """Invalid bodies keep their invalid parts; only a generation budget that is valid but
    large (or absent: chat's default is the whole context) is brought down to MAX_TOKENS."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "min_tokens", "n"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def test_router_fuzz_no_5xx_no_hang(fuzz_router: Router, llama_pair: tuple[Worker, Worker],
                                    colocated_worker: Worker) -> None:
    raw = httpx.get(f"{fuzz_router.url}/openapi.json", timeout=10).json()
    model = httpx.get(f"{fuzz_router.url}/v1/models", timeout=10).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(bounded(raw, model))
    statuses: dict[int, int] = {}
    session = requests.Session()

    def fuzz(path: str, mode: schemathesis.GenerationMode, examples: int) -> None:
        # no shrinking: the server is stateful, so the first failure is the one to report
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            clamp(case.body)
            response = case.call(base_url=fuzz_router.url, session=session, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (path, case.body, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]  # an OpenAI-style body, never a bare text
                assert error["message"] and error["type"], response.text

        check()

    for path in PATHS:
        fuzz(path, schemathesis.GenerationMode.POSITIVE, 90)
        fuzz(path, schemathesis.GenerationMode.NEGATIVE, 60)
    # both outcomes were exercised: requests served and requests refused
    assert statuses.get(200, 0) > 50 and sum(n for s, n in statuses.items() if s >= 400) > 20, (
        statuses)
