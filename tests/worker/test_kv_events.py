"""Every worker reports its prefix cache (issue 24, item 1), with a real engine: the snapshot holds
the keys of exactly the blocks a request left cached (prompt and generated tokens), the long
poll returns the change, evictions come as removals, the routes need the deployment token, and
the P and D of the session's pair report too. `test_kvrelay.py` covers the relay's recovery
paths against a stand-in publisher."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.kvindex.blockset import replay
from splitserve.kvindex.keys import prefix_keys
from splitserve.kvindex.messages import EVENTS_PATH, SNAPSHOT_PATH, KvChange, KvEvents, KvSnapshot
from tests.support import cores
from tests.support.workers import Worker, auth_headers, launch, model_name, two_legs

BLOCKS = 12  # the tiny worker's KV cache, in blocks (one is vLLM's null block)


@pytest.fixture(scope="module")
def tiny(llama_ckpt: Path) -> Iterator[Worker]:
    """A plain worker whose KV cache holds 11 blocks of 128 tokens: a few prompts evict."""
    w = launch(llama_ckpt, "kv-events-tiny", None, cpus=cores.spare_cores(None),
               max_model_len=1024, extra_args=("--num-gpu-blocks-override", str(BLOCKS)))
    yield w
    w.stop()


def snapshot(w: Worker) -> KvSnapshot:
    r = httpx.get(f"{w.url}{SNAPSHOT_PATH}", headers=auth_headers(), timeout=10)
    r.raise_for_status()
    return KvSnapshot.from_json(r.json())


def events(w: Worker, after: int, wait_s: float = 0.0, epoch: str | None = None
           ) -> httpx.Response:
    params: dict[str, str | float] = {"after": after, "wait_s": wait_s}
    if epoch is not None:
        params["epoch"] = epoch
    return httpx.get(f"{w.url}{EVENTS_PATH}", params=params, headers=auth_headers(),
                     timeout=wait_s + 10)


def follow(w: Worker, snap: KvSnapshot, done: Callable[[set[int]], bool],
           timeout_s: float = 20.0) -> list[KvChange]:
    """Long-poll the changes after `snap` until `done(keys)` holds for the reader's view."""
    changes: list[KvChange] = []
    after, deadline = snap.seq, time.monotonic() + timeout_s
    while not done(replay(snap, changes)):
        assert time.monotonic() < deadline, f"view after {len(changes)} changes: not there"
        r = events(w, after, wait_s=2.0, epoch=snap.epoch)
        assert r.status_code == 200, r.text
        ev = KvEvents.from_json(r.json())
        assert ev.epoch == snap.epoch and [c.seq for c in ev.changes] == list(
            range(after + 1, ev.seq + 1))
        changes += ev.changes
        after = ev.seq
    return changes


def check_contract(w: Worker, snap0: KvSnapshot) -> KvSnapshot:
    """A snapshot now equals `snap0` with every change after it applied."""
    now = snapshot(w)
    assert now.exact and now.epoch == snap0.epoch
    changes: list[KvChange] = []
    after = snap0.seq
    while after < now.seq:
        ev = KvEvents.from_json(events(w, after, epoch=snap0.epoch).json())
        changes += ev.changes
        after = ev.seq
    assert set(now.keys) == replay(snap0, [c for c in changes if c.seq <= now.seq])
    return now


def complete(w: Worker, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model_name(w), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{w.url}/v1/completions", json=body, headers=auth_headers(), timeout=120)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def prompt_of(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 1000 for i in range(n)]


def test_the_snapshot_holds_the_blocks_of_the_prompt_and_of_generated_tokens(tiny: Worker
                                                                            ) -> None:
    snap0 = snapshot(tiny)
    assert snap0.exact and snap0.block_size == 128
    prompt = prompt_of(1, 250)
    out = complete(tiny, prompt, 10)
    # vLLM caches every full block of the tokens it computed: the prompt and all generated
    # tokens but the last (never fed back); block 1 ends with 6 generated tokens
    computed = (prompt + out)[:len(prompt) + len(out) - 1]
    want = set(prefix_keys(computed, snap0.block_size))
    assert len(want) == 2
    changes = follow(tiny, snap0, lambda keys: want <= keys)
    assert changes[0].stored  # the long poll returned the change
    now = check_contract(tiny, snap0)
    assert set(now.keys) - set(snap0.keys) == want  # nothing else: exactly these were added


def test_evictions_come_as_removals_and_the_view_stays_exact(tiny: Worker) -> None:
    snap0 = snapshot(tiny)
    sent: set[int] = set(snap0.keys)
    last: set[int] = set()
    for seed in range(10, 14):  # 4 prompts of 4 full blocks each, in 11 blocks
        prompt = prompt_of(seed, 520)
        complete(tiny, prompt, 1)
        last = set(prefix_keys(prompt, 128))
        sent |= last
    final = last
    changes = follow(tiny, snap0, lambda keys: final <= keys)
    assert any(c.removed for c in changes), "a KV cache of 11 blocks evicted nothing"
    now = check_contract(tiny, snap0)
    assert set(now.keys) <= sent and len(now.keys) <= BLOCKS - 1


def test_the_routes_need_the_deployment_token_and_a_reader_in_step(tiny: Worker) -> None:
    for path in (SNAPSHOT_PATH, f"{EVENTS_PATH}?after=0"):
        assert httpx.get(f"{tiny.url}{path}", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer not-the-token"}
        assert httpx.get(f"{tiny.url}{path}", headers=wrong, timeout=10).status_code == 401
    snap = snapshot(tiny)
    assert events(tiny, snap.seq + 5).status_code == 410
    assert events(tiny, snap.seq, epoch="another-life").status_code == 410
    t0 = time.monotonic()
    r = events(tiny, snap.seq, wait_s=0.5, epoch=snap.epoch)
    assert r.status_code == 200 and 0.4 < time.monotonic() - t0 < 5
    assert KvEvents.from_json(r.json()).seq == snap.seq
    assert httpx.get(f"{tiny.url}{EVENTS_PATH}", headers=auth_headers(),
                     timeout=10).status_code == 422  # `after` is required
    metrics = httpx.get(f"{tiny.url}/metrics", headers=auth_headers(), timeout=10).text
    assert "splitserve_kv_events_blocks " in metrics and "splitserve_kv_events_exact 1.0" in metrics


def test_p_and_d_report_what_they_cache(llama_pair: tuple[Worker, Worker]) -> None:
    p, d = llama_pair
    for w in (p, d):
        info = httpx.get(f"{w.url}/splitserve/info", headers=auth_headers(), timeout=10).json()
        assert info["kv_events"] is True and info["block_size"] == 128
    snaps = {w: snapshot(w) for w in (p, d)}
    prompt = prompt_of(99, 300)
    tokens, _, rd = two_legs(p, d, prompt, 4, f"kv-events-{time.monotonic_ns()}")
    assert rd is not None and rd.status_code == 200
    want = set(prefix_keys(prompt, 128))  # 2 full blocks: P computed them, D loaded them
    for w in (p, d):
        follow(w, snaps[w], lambda keys: want <= keys)
