"""2P2D through the router: concurrent greedy requests spread over both pools, every output
equals Hugging Face transformers, over tcp and shm, and all four workers drain to zero. Then
the D that holds two conversations dies mid-stream (SIGKILL): each follow-up turn that was
streaming from it is resumed on the other D, and its output stays exact.

The tests that kill D2 (`d2_died_mid_conversations`) come last: no test after them may use D2.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.routers import Router, start_router
from tests.support.workers import Worker, hf_greedy

MAX_TOKENS = 8
LENGTHS = (3, 40, 130, 260, 333, 90, 17, 200)


@pytest.fixture(scope="module")
def pools(llama_pair: tuple[Worker, Worker], second_pair: tuple[Worker, Worker]
          ) -> tuple[list[Worker], list[Worker]]:
    """The session's pair and the package's second pair (its D is killed by the last tests)."""
    (p1, d1), (p2, d2) = llama_pair, second_pair
    return [p1, p2], [d1, d2]


@pytest.fixture(scope="module", params=["tcp", "shm"])
def router_2p2d(request: pytest.FixtureRequest, pools: tuple[list[Worker], list[Worker]],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    ps, ds = pools
    r = start_router(tmp_path_factory.mktemp("router-2p2d"), "--prefill", *[p.url for p in ps],
                     "--decode", *[d.url for d in ds], "--kv-transport", request.param)
    yield r
    r.stop()


def generate(url: str, model: str, prompt: list[int], stream: bool) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    out: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    out += c.get("token_ids") or []
    return out


def transfers_loaded(d: Worker) -> int:
    return int(d.state()["transfers"]["counts"].get("recv_loaded", 0))


def local_prefills(router: Router, d: Worker) -> int:
    return int(router_metric(router, "splitserve_router_local_prefills_total", url=d.url))


def test_concurrent_requests_use_both_pools_and_match_transformers(
        router_2p2d: Router, pools: tuple[list[Worker], list[Worker]], llama_ckpt: Path) -> None:
    ps, ds = pools
    model = str(ps[0].cfg.model)
    before = [transfers_loaded(d) + local_prefills(router_2p2d, d) for d in ds]
    prompts = [[7 + (i * 29 + n * 3) % 900 for i in range(n)] for n in LENGTHS]
    jobs = [(p, i % 2 == 0) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: generate(router_2p2d.url, model, j[0], j[1]), jobs))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(llama_ckpt, prompt, MAX_TOKENS), f"{len(prompt)} tokens"
    # Each D served some of them: by a transfer from P, or whole (prefill on D, short prompts)
    gained = [transfers_loaded(d) + local_prefills(router_2p2d, d) - b
              for d, b in zip(ds, before, strict=True)]
    assert all(g > 0 for g in gained), f"a decode worker served no request: {gained}"
    served = {w["url"]: w for w in router_2p2d.workers()}
    assert all(served[p.url]["role"] == "prefill" for p in ps)


# --- the D that held a conversation dies --------------------------------------------------
BLOCK = 128  # vLLM-CPU's block size
TURN1_PROMPT, TURN1_TOKENS = 200, 100  # D computes 299 tokens: 2 full blocks, 56 of its own
TURN2_TOKENS = 1200  # ~1 s of D here: a wide margin to kill D mid-stream (prompt + it < 2048)
SPLIT_USER, LOCAL_USER = 200, 40  # new user tokens: 244 uncached (> 128: split), 84 (local)
SPLIT_RID, LOCAL_RID = "conv-split-turn2", "conv-local-turn2"  # the follow-ups' request ids


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 41 + i * 17) % 1000 for i in range(length)]


def cache_of(router: Router, url: str) -> dict[str, Any]:
    for w in router.workers():
        if w["url"] == url:
            return dict(w["cache"] or {})
    raise AssertionError(f"{url} is not one of the router's workers")


def wait_synced(router: Router, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((w["cache"] or {}).get("synced") for w in router.workers()):
        assert time.monotonic() < deadline, router.workers()
        time.sleep(0.1)


def wait_cached(router: Router, url: str, tokens: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cache_of(router, url).get("tokens", 0) < tokens:
        assert time.monotonic() < deadline, (tokens, cache_of(router, url))
        time.sleep(0.05)


def router_metric(router: Router, name: str, **labels: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{")
               and all(f'{k}="{v}"' in line for k, v in labels.items()))


def inflight_on(router: Router, url: str) -> int:
    return next(int(w["inflight"]) for w in router.workers() if w["url"] == url)


@dataclass
class Streamed:
    """One streamed completion read in a thread: its token ids as they arrive, the error events
    in its stream, and the router's timings (the stream's closing comment, split path only)."""

    ids: list[int] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, Any] | None = None
    done: bool = False  # `data: [DONE]` arrived
    failure: BaseException | None = None  # the client's own (connection lost, bad status)
    thread: threading.Thread | None = None

    def start(self, router: Router, model: str, prompt: list[int], max_tokens: int, rid: str
              ) -> Streamed:
        self.thread = threading.Thread(target=self._read, daemon=True,
                                       args=(router, model, prompt, max_tokens, rid))
        self.thread.start()
        return self

    def _read(self, router: Router, model: str, prompt: list[int], max_tokens: int, rid: str
              ) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        try:
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                              headers={"X-Request-Id": rid}, timeout=300) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith(": splitserve-timings "):
                        self.timings = json.loads(line.split(" ", 2)[2])
                    elif line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors.append(event)
                        for c in event.get("choices", []):
                            self.ids += c.get("token_ids") or []
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not the thread
            self.failure = exc

    def join(self, timeout_s: float = 300.0) -> Streamed:
        assert self.thread is not None
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the stream did not end in {timeout_s} s"
        return self


@dataclass
class Resumption:
    """What the kill left: each conversation's follow-up stream (`split`: D2 held the
    conversation's head, P sent the rest; `local`: D2 held all but a few tokens and prefilled
    them itself), its prompt and reference, and how far each stream was when D2 died."""

    router: Router
    split: Streamed
    local: Streamed
    prompts: dict[str, list[int]]
    wants: dict[str, list[int]]
    at_kill: dict[str, int]
    log: str = ""


@pytest.fixture(scope="module")
def d2_died_mid_conversations(pools: tuple[list[Worker], list[Worker]], llama_ckpt: Path,
                              tmp_path_factory: pytest.TempPathFactory
                              ) -> Iterator[Resumption]:
    """Two conversations whose first turn ran on D2 (steered there); their follow-up turns go to
    D2 by its cache (one split with a delta transfer, one prefilled on D2), both stream from D2,
    and D2 is SIGKILLed once each has streamed tokens of D2's. Kills D2 for good."""
    ps, ds = pools
    d1, d2 = ds
    model = str(ps[0].cfg.model)
    router = start_router(tmp_path_factory.mktemp("router-2p2d-resume"),
                          "--prefill", *[p.url for p in ps], "--decode", d1.url, d2.url)
    try:
        wait_synced(router)
        # Turn 1 of both conversations on D2 (D1 drained), split: P prefills, D2 decodes.
        router.route_only(*[p.url for p in ps], d2.url)
        before = cache_of(router, d2.url)["tokens"]
        history = {}
        for name, seed in (("split", 1101), ("local", 1102)):
            prompt = prompt_of(TURN1_PROMPT, seed)
            r = httpx.post(f"{router.url}/v1/completions", timeout=300, json={
                "model": model, "prompt": prompt, "max_tokens": TURN1_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            t = json.loads(r.headers["x-splitserve-timings"])
            assert t["mode"] == "split" and t["decode"] == d2.url, t
            out = r.json()["choices"][0]["token_ids"]
            assert out == hf_greedy(llama_ckpt, prompt, TURN1_TOKENS), name
            history[name] = prompt + out
        # D2 reports each conversation's first 2 blocks (its prompt and 56 tokens D2 made)
        wait_cached(router, d2.url, before + 2 * 2 * BLOCK)
        router.route_only(*[p.url for p in ps], d1.url, d2.url)  # the router chooses again
        prompts = {"split": history["split"] + prompt_of(SPLIT_USER, 1103),
                   "local": history["local"] + prompt_of(LOCAL_USER, 1104)}
        wants = {k: hf_greedy(llama_ckpt, p, TURN2_TOKENS) for k, p in prompts.items()}
        split = Streamed().start(router, model, prompts["split"], TURN2_TOKENS, SPLIT_RID)
        local = Streamed().start(router, model, prompts["local"], TURN2_TOKENS, LOCAL_RID)
        # Kill D2 once both streams have tokens of D2's (a split stream's first token is P's)
        # and both legs are open there, none on D1.
        deadline = time.monotonic() + 180
        while not (len(split.ids) >= 4 and len(local.ids) >= 4
                   and inflight_on(router, d2.url) == 2):
            assert time.monotonic() < deadline, (len(split.ids), len(local.ids),
                                                 router.workers())
            for s in (split, local):
                assert s.thread is not None and s.thread.is_alive(), s
            time.sleep(0.02)
        assert inflight_on(router, d1.url) == 0, router.workers()
        d2.kill()
        at_kill = {"split": len(split.ids), "local": len(local.ids)}
        split.join()
        local.join()
        print(f"\nD2 killed with {at_kill} of {TURN2_TOKENS} tokens streamed; "
              f"split: {len(split.ids)} in all, errors {split.errors}, "
              f"client failure {split.failure!r}, timings {split.timings}; "
              f"local: {len(local.ids)} in all, errors {local.errors}, "
              f"client failure {local.failure!r}")
        # what both tests rely on: both were mid-stream on D2, the local one was prefilled on
        # D2, and what each streamed before the kill was exact
        assert all(4 <= n < TURN2_TOKENS for n in at_kill.values()), at_kill
        assert router_metric(router, "splitserve_router_local_prefills_total",
                             url=d2.url) == 1
        for k, s in (("split", split), ("local", local)):
            assert s.ids[:at_kill[k]] == wants[k][:at_kill[k]], k
        yield Resumption(router, split, local, prompts, wants, at_kill,
                         router.log.read_text(errors="replace"))
    finally:
        router.stop()


def test_the_d_holding_a_conversation_dies_and_the_stream_resumes_on_the_other_d_exactly(
        d2_died_mid_conversations: Resumption, pools: tuple[list[Worker], list[Worker]]
        ) -> None:
    """Issue 24: "The D that held a conversation dies: the stream is resumed elsewhere, exact"
    (the follow-up turn split, P sending D2 only what it lacked)."""
    res = d2_died_mid_conversations
    d1, d2 = pools[1]
    s = res.split
    assert s.failure is None and s.errors == [] and s.done, (s.failure, s.errors)
    # the whole stream, t1 and D2's tokens and D1's after the kill, equals transformers
    assert s.ids == res.wants["split"]
    t = s.timings
    assert t is not None
    # routed by D2's cache (D1 held nothing of it): 2 blocks, 56 tokens of them D2's own
    # answer; P sent only the rest; then resumed once, on D1
    assert t["mode"] == "split" and t["d_cached"] == 2 * BLOCK, t
    assert t["retries"] == 1 and t["decode"] == d1.url, t
    assert f"request {SPLIT_RID}: decode leg on {d2.url} failed" in res.log
    assert router_metric(res.router, "splitserve_router_retries_total", leg="decode") >= 1
    assert d2.proc.poll() is not None and d1.proc.poll() is None


def test_a_conversation_prefilled_on_the_d_that_dies_resumes_on_the_other_d_exactly(
        d2_died_mid_conversations: Resumption, pools: tuple[list[Worker], list[Worker]]
        ) -> None:
    """The same, for the follow-up turn that D2 prefilled itself (all but 84 tokens cached):
    prefill on D is D's leg alone, and resumes as any D leg does (it ran on the unsplit path,
    which retries only before the first byte, until be33e7b)."""
    res = d2_died_mid_conversations
    d1, d2 = pools[1]
    s = res.local
    assert s.failure is None and s.errors == [] and s.done, (s.failure, s.errors)
    assert s.ids == res.wants["local"]
    # resumed on D1 as a split request's D leg is, and said so
    assert f"request {LOCAL_RID}: decode leg on {d2.url} failed" in res.log
    t = s.timings
    assert t is not None and t["mode"] == "local" and t["d_cached"] == 2 * BLOCK, t
    assert t["retries"] == 1 and t["decode"] == d1.url, t
