"""Cancellation, refusal, errors, metrics, worker listing and the admin endpoint, end to end."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.routers import Router, start_router
from tests.support.workers import TOKEN, Worker, auth_headers


def model_of(pair: tuple[Worker, Worker]) -> str:
    return str(pair[0].cfg.model)


def test_client_disconnect_mid_stream_frees_every_worker(
        router_pd: Router, llama_pair: tuple[Worker, Worker]) -> None:
    body = {"model": model_of(llama_pair), "prompt": [5 + i % 900 for i in range(300)],
            "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{router_pd.url}/v1/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 5:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while any(w["inflight"] for w in router_pd.workers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(w["inflight"] == 0 for w in router_pd.workers())
    # and the drain check after the test: no KV blocks in use, nothing staged, no held sends


def test_unsplittable_parameters_run_whole_exactly(
        router_pd: Router, colocated_worker: Worker, llama_pair: tuple[Worker, Worker]) -> None:
    # seeded sampling, two choices, a stop string and a penalty: all run whole on one worker,
    # so the answer is exactly the colocated worker's
    body = {"model": model_of(llama_pair), "prompt": "A quiet morning in the hills",
            "max_tokens": 12, "temperature": 0.8, "seed": 5, "stop": ["ai"], "n": 2,
            "frequency_penalty": 0.4}
    routed = httpx.post(f"{router_pd.url}/v1/completions", json=body, timeout=60)
    direct = httpx.post(f"{colocated_worker.url}/v1/completions", json=body,
                        headers=auth_headers(), timeout=60).json()
    assert routed.status_code == 200
    assert [c["text"] for c in routed.json()["choices"]] == [c["text"] for c in direct["choices"]]
    assert len(routed.json()["choices"]) == 2


def test_refusal_names_the_parameter_and_api_key(llama_pair: tuple[Worker, Worker],
                                                 router_logs: Path) -> None:
    p, d = llama_pair
    router = start_router(router_logs, "--prefill", p.url, "--decode", d.url,
                          "--unsplittable", "refuse", env={"SPLITSERVE_API_KEY": "sk-test"})
    key = {"Authorization": "Bearer sk-test"}
    try:
        base = {"model": model_of(llama_pair), "prompt": "x", "max_tokens": 4}
        for wrong in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-test"}):
            r = httpx.post(f"{router.url}/v1/completions", json=base, timeout=60, headers=wrong)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            r = httpx.get(f"{router.url}/v1/models", timeout=10, headers=wrong)  # as vLLM
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = httpx.get(f"{router.url}/v1/models", timeout=10, headers=key)
        assert r.json()["data"][0]["id"] == model_of(llama_pair)
        for extra, param in (({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"),
                             ({"presence_penalty": 1.0}, "presence_penalty"),
                             ({"stop": "."}, "stop"), ({"min_tokens": 2}, None)):
            r = httpx.post(f"{router.url}/v1/completions", json=base | extra, timeout=60,
                           headers=key)
            if param is None:
                assert r.status_code == 200  # min_tokens is split exactly (1 on P, rest on D)
                continue
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"] and err["code"] == 400
    finally:
        router.stop()


def test_errors_are_openai_shaped(router_pd: Router, llama_pair: tuple[Worker, Worker]) -> None:
    url = f"{router_pd.url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"X-Request-Id": "bad-1"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert r.headers["x-request-id"] == "bad-1"
    r = httpx.post(url, json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # vLLM's own validation, on the P leg, comes back unchanged (never as a 200)
    r = httpx.post(url, json={"model": model_of(llama_pair), "prompt": "x",
                              "max_tokens": 100000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_metrics_and_workers(router_pd: Router, llama_pair: tuple[Worker, Worker]) -> None:
    body = {"model": model_of(llama_pair), "prompt": "metrics please", "max_tokens": 3,
            "temperature": 0}
    assert httpx.post(f"{router_pd.url}/v1/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", f"{router_pd.url}/v1/completions", json=body | {"stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    text = httpx.get(f"{router_pd.url}/metrics").text
    for family in ("splitserve_router_prefill_seconds_count", "splitserve_router_kv_bytes_count",
                   "splitserve_router_handover_seconds_count",
                   "splitserve_router_decode_queue_seconds_count",
                   "splitserve_router_decode_wait_seconds_count",
                   'splitserve_router_requests_total{endpoint="completion",mode="split",'
                   'outcome="ok"}'):
        line = next(x for x in text.splitlines() if x.startswith(family))
        assert float(line.rsplit(" ", 1)[1]) >= 1, line
    workers = {w["role"]: w for w in router_pd.workers()}
    assert set(workers) == {"prefill", "decode"} and all(w["healthy"] for w in workers.values())
    assert workers["decode"]["kv_endpoint"]["remote_port"] == llama_pair[1].kv_port
    assert workers["decode"]["staging_capacity_bytes"] > 0
    assert httpx.get(f"{router_pd.url}/health").status_code == 200


def test_admin_add_drain_remove_loses_no_request(
        llama_pair: tuple[Worker, Worker], colocated_worker: Worker, router_logs: Path) -> None:
    p, d = llama_pair
    router = start_router(router_logs, "--prefill", p.url, "--decode", d.url)
    admin = f"{router.url}/admin/workers"
    model = model_of(llama_pair)
    try:
        assert httpx.post(admin, json={"url": colocated_worker.url, "role": "colocated"}
                          ).status_code == 401
        r = httpx.post(admin, json={"url": colocated_worker.url, "role": "colocated"},
                       headers=auth_headers())
        assert r.status_code == 201 and r.json()["healthy"]
        # drain D: split is no longer possible, requests run whole on the colocated worker
        r = httpx.post(f"{admin}/drain", json={"url": d.url}, headers=auth_headers())
        assert r.json()["workers"][0]["draining"]
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": "drained", "max_tokens": 3})
        assert r.status_code == 200 and "x-splitserve-timings" not in r.headers
        httpx.post(f"{admin}/drain", json={"url": d.url, "undrain": True},
                   headers=auth_headers())
        # remove the colocated worker and D while a long stream is open on D: the stream ends
        # complete, and only then is D gone
        body = {"model": model, "prompt": "long one", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        result: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                              timeout=120) as s:
                result["events"] = [x for x in s.iter_lines() if x.startswith("data: ")]

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while not any(w["inflight"] for w in router.workers() if w["role"] == "decode"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(f"{admin}/remove", json={"url": d.url}, headers=auth_headers(),
                       timeout=120)
        assert r.status_code == 200 and r.json()["workers"][0]["removed"]
        reader.join(60)
        events = result["events"]
        assert isinstance(events, list) and events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][6:])["usage"]
        assert usage["completion_tokens"] == 200
        assert {w["role"] for w in router.workers()} == {"prefill", "colocated"}
        assert httpx.post(f"{admin}/remove", json={"url": "http://127.0.0.1:1"},
                          headers=auth_headers()).status_code == 404
    finally:
        router.stop()
    assert TOKEN not in Path(router.log).read_text()


def sse_text(body: str) -> str:
    events = [json.loads(line[6:]) for line in body.splitlines()
              if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


@pytest.mark.parametrize("stream", [False, True])
def test_colocated_router_is_plain_load_balancing(
        router_colocated: Router, colocated_worker: Worker, stream: bool) -> None:
    body = {"model": str(colocated_worker.cfg.model), "prompt": "Hello", "max_tokens": 5,
            "temperature": 0, "stream": stream}
    r = httpx.post(f"{router_colocated.url}/v1/completions", json=body, timeout=60,
                   headers={"X-Request-Id": f"colo-{stream}"})
    assert r.status_code == 200 and r.headers["x-request-id"] == f"colo-{stream}"
    direct = httpx.post(f"{colocated_worker.url}/v1/completions", json=body,
                        headers=auth_headers(), timeout=60)
    if stream:
        # vLLM may put two tokens in one event when its consumer lags, so compare the joined
        # text, not the number of events
        assert sse_text(r.text) == sse_text(direct.text) and r.text.endswith("data: [DONE]\n\n")
        assert f"cmpl-colo-{stream}" in r.text
    else:
        assert r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
