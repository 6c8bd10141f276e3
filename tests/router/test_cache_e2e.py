"""Cache-aware routing end to end: real workers that report their caches, a router that follows
them, token-exact greedy output against transformers when a repeated prefix goes to the P that
holds it, when a request is prefilled on the D that holds most of it, and for a multi-turn chat;
a worker whose event stream is lost is routed by load; a router started later (a restarted
router) rebuilds the same index within seconds; two routers over the pool hit the cache as one
does, and killing one of them costs only the requests it held.

Workers: the session's llama P and D, and the package's second P (behind a proxy that can cut
its cache report). Prompts are fresh per test (their own seeds), so no earlier test's cache
hits them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve.worker.launch import free_port
from tests.support.proxy import Proxy
from tests.support.routers import Router, start_router
from tests.support.workers import Worker, auth_headers, chat_prompt_ids, hf_greedy

MAX_TOKENS = 8
BLOCK = 128  # vLLM-CPU's block size


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 41 + i * 17) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def proxied_p2(second_p: Worker) -> Iterator[Proxy]:
    proxy = Proxy(second_p.url).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def cache_router(llama_pair: tuple[Worker, Worker], proxied_p2: Proxy,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    p1, d = llama_pair
    r = start_router(tmp_path_factory.mktemp("router-cache"), "--prefill", p1.url,
                     proxied_p2.url, "--decode", d.url)
    try:
        wait_synced(r)
        yield r
    finally:
        r.stop()


def workers_view(router: Router) -> dict[str, Any]:
    return dict(httpx.get(f"{router.url}/workers", timeout=5).json())


def cache_of(router: Router, url: str) -> dict[str, Any]:
    for w in workers_view(router)["workers"]:
        if w["url"] == url:
            return dict(w["cache"] or {})
    raise AssertionError(f"{url} is not one of the router's workers")


def wait_synced(router: Router, timeout_s: float = 30.0) -> float:
    """Until every worker's view is synced; the router's rebuild time (start -> all synced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = workers_view(router)
        if all((w["cache"] or {}).get("synced") for w in view["workers"]):
            return float(view["kv_index"]["all_synced_after_s"])
        assert time.monotonic() < deadline, view
        time.sleep(0.1)


def wait_cached(router: Router, url: str, tokens: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cache_of(router, url).get("tokens", 0) < tokens:
        assert time.monotonic() < deadline, cache_of(router, url)
        time.sleep(0.05)


def warm(worker_url: str, model: str, prompt: list[int]) -> None:
    """Send `prompt` straight to one worker (a plain request): its prefix cache holds it."""
    r = httpx.post(f"{worker_url}/v1/completions", headers=auth_headers(), timeout=60,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def complete(router: Router, model: str, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], json.loads(r.headers["x-splitserve-timings"])


def metric(router: Router, name: str, **labels: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_repeated_prefix_goes_to_the_p_that_holds_it(
        cache_router: Router, llama_pair: tuple[Worker, Worker], proxied_p2: Proxy,
        second_p: Worker, llama_ckpt: Path) -> None:
    model = str(llama_ckpt)
    head = prompt_of(300, 501)
    warm(second_p.url, model, head)  # the second P holds 2 blocks of it; load would pick P1
    wait_cached(cache_router, proxied_p2.url, 2 * BLOCK)
    prompt = head + prompt_of(200, 502)  # 500 tokens, 244 of them new: split, not on D
    got, t = complete(cache_router, model, prompt)
    assert got == hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
    assert t["mode"] == "split" and t["prefill"] == proxied_p2.url, t
    assert t["p_cached"] == 2 * BLOCK and t["kv_status"] == "loaded", t
    # the prediction against the engine's own count (this P reports it)
    reported = metric(cache_router, "splitserve_router_cached_reported_tokens_total",
                      url=proxied_p2.url)
    predicted = metric(cache_router, "splitserve_router_cached_predicted_reported_tokens_total",
                       url=proxied_p2.url)
    assert reported == predicted == 2 * BLOCK


def test_prefill_on_the_d_that_holds_all_but_a_few_tokens(
        cache_router: Router, llama_pair: tuple[Worker, Worker], llama_ckpt: Path) -> None:
    _, d = llama_pair
    model = str(llama_ckpt)
    head = prompt_of(300, 503)
    warm(d.url, model, head)
    wait_cached(cache_router, d.url, 2 * BLOCK)
    prompt = head + prompt_of(20, 504)  # 320 tokens: D reuses 256, computes 64 <= 128
    want = hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
    before = metric(cache_router, "splitserve_router_local_prefills_total", url=d.url)
    got, t = complete(cache_router, model, prompt)
    assert got == want and t["mode"] == "local" and t["d_cached"] == 2 * BLOCK, t
    # streamed too: the worker's own stream, relayed
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    ids: list[int] = []
    with httpx.stream("POST", f"{cache_router.url}/v1/completions", json=body,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids += c.get("token_ids") or []
    assert ids == want
    assert metric(cache_router, "splitserve_router_local_prefills_total",
                  url=d.url) == before + 2


def test_multi_turn_chat_is_exact_and_reuses_the_conversation(
        cache_router: Router, llama_ckpt: Path) -> None:
    model = str(llama_ckpt)
    system = " ".join(f"Rule {i}: answer the traveller about the harbour, the tides and "
                      f"the lighthouse number {i}." for i in range(24))
    messages: list[dict[str, str]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": "Where is the lighthouse?"}]
    used = []
    for turn in range(3):
        prompt = chat_prompt_ids(model, messages)
        want = hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{cache_router.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["token_ids"] == want, turn
        t = json.loads(r.headers["x-splitserve-timings"])
        used.append(t)
        messages += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And what about turn {turn}?"}]
    assert len(chat_prompt_ids(model, messages[:2])) > 2 * BLOCK
    # every follow-up turn found the conversation cached: on D (prefill on D, or a D prefix
    # for the connector), or at least on the P that computed the turn before
    for t in used[1:]:
        assert t["mode"] == "local" or t.get("d_cached", 0) > 0 or t.get("p_cached", 0) > 0, t


def test_a_lost_event_stream_routes_that_worker_by_load(
        cache_router: Router, llama_pair: tuple[Worker, Worker], proxied_p2: Proxy,
        second_p: Worker, llama_ckpt: Path) -> None:
    p1, _ = llama_pair
    model = str(llama_ckpt)
    unsynced = metric(cache_router, "splitserve_router_kv_unsynced_picks_total",
                      pool="prefill")
    proxied_p2.cut_kv = True
    try:
        deadline = time.monotonic() + 30
        while cache_of(cache_router, proxied_p2.url).get("synced"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert metric(cache_router, "splitserve_router_worker_kv_synced",
                      url=proxied_p2.url) == 0
        head = prompt_of(300, 505)
        warm(second_p.url, model, head)  # the second P holds it, but the router cannot know
        prompt = head + prompt_of(200, 506)
        got, t = complete(cache_router, model, prompt)
        assert got == hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
        assert t["prefill"] == p1.url and t["p_cached"] == 0, t  # by load: P1 (ties: first)
        assert metric(cache_router, "splitserve_router_kv_unsynced_picks_total",
                      pool="prefill") > unsynced
    finally:
        proxied_p2.cut_kv = False
    wait_synced(cache_router)
    assert cache_of(cache_router, proxied_p2.url)["tokens"] >= 2 * BLOCK  # rebuilt: exact


def test_a_router_started_later_rebuilds_the_same_index_within_seconds(
        cache_router: Router, llama_pair: tuple[Worker, Worker], proxied_p2: Proxy,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    p1, d = llama_pair
    spawned = time.monotonic()
    later = start_router(tmp_path_factory.mktemp("router-cache-later"), "--prefill", p1.url,
                         proxied_p2.url, "--decode", d.url)
    try:
        rebuild_s = wait_synced(later)
        print(f"\nrouter start -> every worker's view synced: {rebuild_s:.3f} s "
              f"(process spawned -> synced, seen here: {time.monotonic() - spawned:.2f} s)")
        assert rebuild_s < 10
        for url in (p1.url, proxied_p2.url, d.url):
            a, b = cache_of(cache_router, url), cache_of(later, url)
            assert (a["epoch"], a["seq"], a["blocks"]) == (b["epoch"], b["seq"], b["blocks"])
    finally:
        later.stop()


def settle(routers: list[Router], timeout_s: float = 15.0) -> None:
    """A user's think time, long enough for every router to have heard: until each router sees
    no open leg of its own or of its peers on any worker (a peer's share is up to one health
    interval old by contract) and all routers hold the same cache report of every worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = [workers_view(r)["workers"] for r in routers]
        idle = all(w["inflight"] == 0 and w["peer_inflight"] == 0 for v in views for w in v)
        caches = [{w["url"]: (w["cache"] or {}).get("seq") for w in v} for v in views]
        if idle and all(c == caches[0] for c in caches):
            return
        assert time.monotonic() < deadline, views
        time.sleep(0.1)


def hit_rate(routers: list[Router], model: str, seed: int) -> float:
    """Send one stream (3 prefixes of 2 blocks, each asked 3 times with a new tail) in turn
    through `routers`, each request after the one before has settled; the share of prompt
    tokens the computing worker found cached (P's for a split request, D's for one prefilled
    on D), as each router's timings tell it."""
    hit = total = 0
    for turn in range(3):
        for k in range(3):
            prompt = prompt_of(2 * BLOCK, seed + k) + prompt_of(150, seed + 10 * turn + k + 50)
            router = routers[(3 * turn + k) % len(routers)]
            _, t = complete(router, model, prompt)
            hit += t["d_cached"] if t["mode"] == "local" else t["p_cached"]
            total += len(prompt)
            time.sleep(0.2)  # a user's think time: the engine's reports of this turn go out
            settle(routers)
    return hit / total


def test_two_routers_over_one_pool_hit_as_often_as_one(
        cache_router: Router, llama_pair: tuple[Worker, Worker], proxied_p2: Proxy,
        llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    p1, d = llama_pair
    other = start_router(tmp_path_factory.mktemp("router-peer"), "--prefill", p1.url,
                         proxied_p2.url, "--decode", d.url, "--peer", cache_router.url)
    try:
        wait_synced(other)
        one = hit_rate([cache_router], str(llama_ckpt), 700)
        two = hit_rate([cache_router, other], str(llama_ckpt), 800)  # same shape, fresh ids
        print(f"\nprefix hit rate: one router {one:.3f}, two routers {two:.3f}")
        assert one > 0.3  # the stream does repeat itself, and cache routing finds it
        assert abs(two - one) <= 0.02
        assert [p["url"] for p in workers_view(other)["peers"]] == [cache_router.url]
        # the peers' routes are the deployment's: the token, and a well-formed list
        load = f"{other.url}/splitserve/router/load"
        assert httpx.get(load, timeout=5).status_code == 401
        legs = httpx.get(load, headers=auth_headers(), timeout=5).json()["workers"]
        assert {w["url"] for w in legs} == {p1.url, proxied_p2.url, d.url}
        bad = httpx.put(f"{other.url}/admin/peers", json={"peers": ["no-scheme:1"]},
                        headers=auth_headers(), timeout=5)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "peers"
        assert httpx.put(f"{other.url}/admin/peers", json={"peers": []},
                         timeout=5).status_code == 401
    finally:
        other.stop()


def stream_ids(router: Router, model: str, prompt: list[int], max_tokens: int,
               first: threading.Event | None = None) -> list[int]:
    """A streamed completion's token ids; sets `first` at the first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    ids: list[int] = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids += c.get("token_ids") or []
                if ids and first is not None:
                    first.set()
    return ids


def test_killing_one_router_costs_only_its_own_requests(
        llama_pair: tuple[Worker, Worker], proxied_p2: Proxy, llama_ckpt: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    p1, d = llama_pair
    model = str(llama_ckpt)
    logs = tmp_path_factory.mktemp("router-kill")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    a, b = (start_router(logs, "--prefill", p1.url, proxied_p2.url, "--decode", d.url,
                         "--peer", urls[1 - i], port=ports[i]) for i in range(2))
    try:
        prompts = [prompt_of(200, 900 + i) for i in range(4)]
        lengths = (400, 400, 160, 160)  # a's two outlive the kill; b's two are exact
        wants = {i: hf_greedy(llama_ckpt, prompts[i], lengths[i]) for i in (2, 3)}
        started = [threading.Event() for _ in prompts]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream_ids, (a, a, b, b)[i], model, prompts[i], lengths[i],
                                   started[i]) for i in range(4)]
            for e in started:
                assert e.wait(60)
            # b counts a's open streams on D in its balance (a counts them as its `inflight`)
            deadline = time.monotonic() + 10
            while not any(w["peer_inflight"] >= 2 for w in b.workers() if w["url"] == d.url):
                assert time.monotonic() < deadline and not futures[0].done(), b.workers()
                time.sleep(0.1)
            a.proc.kill()  # its clients lose their streams; b's go on
            for i in (2, 3):
                assert futures[i].result() == wants[i]
            for f in futures[:2]:
                with pytest.raises(httpx.TransportError):
                    f.result()
        deadline = time.monotonic() + 15
        while any(p["counted"] for p in workers_view(b)["peers"]) or any(
                w["peer_inflight"] for w in b.workers()):
            assert time.monotonic() < deadline, workers_view(b)
            time.sleep(0.2)
        # after it, b serves exactly; the workers' drain is checked after every test
        got, _ = complete(b, model, prompts[2])
        assert got == wants[2][:MAX_TOKENS]
    finally:
        a.stop()
        b.stop()
