"""The router end to end: real vLLM workers and routers on loopback, HTTP to them.

Greedy output through the router (1P1D, tcp and shm, completions and chat, streaming and not,
concurrent mixed lengths) equals a colocated worker and Hugging Face transformers; the joined
stream equals the colocated server's event for event (apart from ids and timestamps).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.rayload import metric
from tests.support.routers import Router
from tests.support.workers import Worker, auth_headers, chat_prompt_ids, hf_greedy

MAX_TOKENS = 10
PROMPT_LENGTHS = (1, 9, 130, 400)


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 37 + i * 13) % 1000 for i in range(length)]


def sse_events(url: str, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[list[Any], list[str]]:
    """(data events, comment lines) of one streamed request."""
    events: list[Any] = []
    comments: list[str] = []
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
            elif line.startswith(":"):
                comments.append(line)
    return events, comments


def without_ids(ev: Any) -> Any:
    """An event minus what names the server rather than the output: ids, timestamps, and the
    fingerprint (a hash of the serving engine's configuration, which differs between a plain
    worker and a P-worker with a connector)."""
    if isinstance(ev, dict):
        return {k: v for k, v in ev.items() if k not in ("id", "created", "system_fingerprint")}
    return ev


def stream_token_ids(events: list[Any]) -> list[int]:
    out: list[int] = []
    for ev in events:
        if isinstance(ev, dict):
            for c in ev["choices"]:
                out += c.get("token_ids") or []
    return out


def generate(url: str, model: str, prompt: list[int], stream: bool) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if stream:
        return stream_token_ids(sse_events(url, "/v1/completions", body, auth_headers())[0])
    r = httpx.post(f"{url}/v1/completions", json=body, headers=auth_headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_greedy_tokens_match_colocated_and_transformers(
        transport: str, request: pytest.FixtureRequest, colocated_worker: Worker,
        llama_pair: tuple[Worker, Worker]) -> None:
    router: Router = request.getfixturevalue("router_pd" if transport == "tcp"
                                             else "router_pd_shm")
    model = str(llama_pair[0].cfg.model)
    offset = 0 if transport == "tcp" else 100  # fresh prompts: D's prefix cache loads nothing
    cases = [(prompt_of(n, 2 * seed + stream + offset), stream)
             for seed, n in enumerate(PROMPT_LENGTHS) for stream in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        routed = list(pool.map(lambda c: generate(router.url, model, c[0], c[1]), cases))
    for (prompt, stream), got in zip(cases, routed, strict=True):
        want = hf_greedy(Path(model), prompt, MAX_TOKENS)
        assert got == want, (len(prompt), stream)
        assert generate(colocated_worker.url, model, prompt, False) == want


def test_every_split_request_moved_its_kv(router_pd: Router, llama_pair: tuple[Worker, Worker]
                                          ) -> None:
    model = str(llama_pair[0].cfg.model)
    # prompts no other test sends, nor a prefix of one (prompt_of(400, 7) starts with
    # prompt_of(200, 7)): a D holding all but 128 tokens of a prompt would prefill it itself
    body = {"model": model, "prompt": prompt_of(200, 907), "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{router_pd.url}/v1/completions", json=body,
                   headers={"X-Request-Id": "kv-check-1"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "kv-check-1"
    timings = json.loads(r.headers["x-splitserve-timings"])
    assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
    assert timings["kv_bytes"] > 0 and timings["p_leg_s"] > 0
    # D's scheduler took the leg after the router sent it and before its first token came back
    assert 0 < timings["d_wait_s"] < timings["d_queue_s"], timings
    # a different prompt of the same length: D has none of it cached, so all of it moves
    events, comments = sse_events(router_pd.url, "/v1/completions",
                                  body | {"stream": True, "prompt": prompt_of(200, 908)})
    streamed = json.loads(comments[-1].split(" ", 2)[2])
    assert streamed["kv_bytes"] == timings["kv_bytes"] and streamed["handover_s"] >= 0
    assert events[-1] == "[DONE]"


def test_chat_tokens_match_transformers(router_pd: Router, llama_pair: tuple[Worker, Worker]
                                        ) -> None:
    model = str(llama_pair[0].cfg.model)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the sea and the stars."}]
    prompt = chat_prompt_ids(model, messages)
    want = hf_greedy(Path(model), prompt, MAX_TOKENS)
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{router_pd.url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["prompt_token_ids"] == prompt and r["choices"][0]["token_ids"] == want
    events, _ = sse_events(router_pd.url, "/v1/chat/completions", body | {"stream": True})
    assert stream_token_ids(events) == want


READ_AS_VLLM_READS: list[tuple[str, dict[str, Any], str]] = [
    # no max_tokens: a completion's own default (16 tokens), not D's leg's
    ("/v1/completions", {"prompt": "The river ran past the old mill and", "ignore_eos": True},
     "split"),
    # text parts: joined by newlines for this template, as vLLM joins them
    ("/v1/chat/completions", {"max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Where does"}, {"type": "text", "text": "the river go?"}]}]},
     "split"),
    # a role vLLM rewrites (developer becomes system here): its own rendering, on one worker
    ("/v1/chat/completions", {"max_tokens": 6, "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
     "whole"),
]


@pytest.mark.parametrize("path, body, mode", READ_AS_VLLM_READS)
def test_requests_vllm_reads_its_own_way_answer_as_colocated(
        path: str, body: dict[str, Any], mode: str, router_pd: Router, colocated_worker: Worker,
        llama_pair: tuple[Worker, Worker]) -> None:
    body = {"model": str(llama_pair[0].cfg.model), "temperature": 0, **body}

    def served(outcome: str) -> float:
        text = httpx.get(f"{router_pd.url}/metrics", timeout=10).text
        return metric(text, "splitserve_router_requests_total", f'mode="{mode}"', outcome)

    before = served('outcome="ok"')
    routed = httpx.post(router_pd.url + path, json=body, timeout=60)
    direct = httpx.post(colocated_worker.url + path, json=body, headers=auth_headers(),
                        timeout=60)
    assert routed.status_code == direct.status_code == 200, (routed.text, direct.text)
    assert served('outcome="ok"') == before + 1  # served the way it should be
    assert without_ids(routed.json()) == without_ids(direct.json())


def test_a_chat_without_a_budget_runs_to_the_end_of_the_context(
        router_pd: Router, colocated_worker: Worker, llama_pair: tuple[Worker, Worker]) -> None:
    """vLLM's chat default is the rest of the context; D's leg is a completion, whose default
    is 16 tokens, so D is told that rest outright. A prompt about 30 tokens short of the
    context (2,048) keeps the run short and the rest above 16."""
    model = str(llama_pair[0].cfg.model)
    def length(words: int) -> int:
        return len(chat_prompt_ids(model, [{"role": "user", "content": "sea " * words}]))

    per_word = length(2) - length(1)
    messages = [{"role": "user", "content": "sea " * ((2018 - length(0)) // per_word)}]
    prompt_len = len(chat_prompt_ids(model, messages))
    assert 24 < 2048 - prompt_len <= 30 + per_word, prompt_len
    body = {"model": model, "messages": messages, "temperature": 0, "ignore_eos": True}
    routed = httpx.post(f"{router_pd.url}/v1/chat/completions", json=body, timeout=120)
    direct = httpx.post(f"{colocated_worker.url}/v1/chat/completions", json=body,
                        headers=auth_headers(), timeout=120)
    assert routed.status_code == direct.status_code == 200, (routed.text, direct.text)
    assert without_ids(routed.json()) == without_ids(direct.json())
    assert routed.json()["usage"]["completion_tokens"] == 2048 - prompt_len


VARIANTS: list[dict[str, Any]] = [
    {},
    {"return_token_ids": True},
    {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True},
     "return_token_ids": True},
    {"max_tokens": 1},
    {"max_tokens": 2, "min_tokens": 2},
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_joined_stream_equals_colocated_event_for_event(
        kind: str, router_pd: Router, colocated_worker: Worker,
        llama_pair: tuple[Worker, Worker]) -> None:
    model = str(llama_pair[0].cfg.model)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    base: dict[str, Any] = (
        {"prompt": "The river ran past the old mill and"} if kind == "completion"
        else {"messages": [{"role": "user", "content": "Where does the river go?"}]})
    for variant in VARIANTS:
        body = {"model": model, "max_tokens": 7, "temperature": 0, "stream": True, **base,
                **variant}
        # vLLM puts two tokens in one event when its consumer lags (a loaded machine); such a
        # run is not comparable event for event, so a mismatch is retried twice before it counts
        for _ in range(3):
            routed, _ = sse_events(router_pd.url, path, body)
            direct, _ = sse_events(colocated_worker.url, path, body, auth_headers())
            if [without_ids(e) for e in routed] == [without_ids(e) for e in direct]:
                break
        assert [without_ids(e) for e in routed] == [without_ids(e) for e in direct], variant
        body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        routed_body = httpx.post(router_pd.url + path, json=body, timeout=60).json()
        direct_body = httpx.post(colocated_worker.url + path, json=body, headers=auth_headers(),
                                 timeout=60).json()
        assert without_ids(routed_body) == without_ids(direct_body), variant


def test_openai_client_through_the_router(router_pd: Router, llama_pair: tuple[Worker, Worker]
                                          ) -> None:
    import openai

    model = str(llama_pair[0].cfg.model)
    client = openai.OpenAI(base_url=f"{router_pd.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [model]
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                     temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
        temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
        temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True))
    assert text == done.choices[0].text
