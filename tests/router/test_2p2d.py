"""2P2D through the router: concurrent greedy requests spread over both pools, every output
equals Hugging Face transformers, over tcp and shm, and all four workers drain to zero."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support import cores
from tests.support.routers import Router, start_router
from tests.support.workers import Worker, hf_greedy, launch

MAX_TOKENS = 8
LENGTHS = (3, 40, 130, 260, 333, 90, 17, 200)


@pytest.fixture(scope="module")
def pools(llama_pair: tuple[Worker, Worker], llama_ckpt: Path
          ) -> Iterator[tuple[list[Worker], list[Worker]]]:
    """The shared pair plus one more prefill and one more decode worker."""
    p1, d1 = llama_pair
    p2 = launch(llama_ckpt, "llama-p2", "prefill", cpus=cores.spare_cores("prefill", 0))
    try:
        d2 = launch(llama_ckpt, "llama-d2", "decode", cpus=cores.spare_cores("decode", 1))
    except BaseException:
        p2.stop()
        raise
    yield [p1, p2], [d1, d2]
    p2.stop()
    d2.stop()


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


def test_concurrent_requests_use_both_pools_and_match_transformers(
        router_2p2d: Router, pools: tuple[list[Worker], list[Worker]], llama_ckpt: Path) -> None:
    ps, ds = pools
    model = str(ps[0].cfg.model)
    before = [transfers_loaded(d) for d in ds]
    prompts = [[7 + (i * 29 + n * 3) % 900 for i in range(n)] for n in LENGTHS]
    jobs = [(p, i % 2 == 0) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: generate(router_2p2d.url, model, j[0], j[1]), jobs))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(llama_ckpt, prompt, MAX_TOKENS), f"{len(prompt)} tokens"
    gained = [transfers_loaded(d) - b for d, b in zip(ds, before, strict=True)]
    assert all(g > 0 for g in gained), f"a decode worker got no transfer: {gained}"
    served = {w["url"]: w for w in router_2p2d.workers()}
    assert all(served[p.url]["role"] == "prefill" for p in ps)
