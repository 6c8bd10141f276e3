"""vLLM's NixlConnector as `splitserve worker --connector nixl` runs it: a real 1P1D on the CPU.

Greedy float32 output of the split equals transformers at every length (whole and partial last
blocks), concurrently, for completions and chat; D loads the prompt's KV instead of computing it;
P's held blocks come back when no D ever reads them; an idle worker does not spin a core.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.support.nixl_helpers import (
    NIXL_LEASE_S,
    decode_leg,
    idle_cpu,
    prefill_leg,
    tokens_by_source,
    two_legs,
    wait_kv_free,
)
from tests.support.workers import Worker, auth_headers, chat_prompt_ids, hf_greedy

MAX_TOKENS = 8
# vLLM-CPU's block is 128 tokens: one token, a partial block, whole blocks, one past a block
LENGTHS = (1, 40, 127, 128, 129, 256, 700, 1500)


def prompt_of(length: int, seed: int) -> list[int]:
    return [5 + (seed * 31 + i * 17) % 1000 for i in range(length)]


def test_worker_advertises_nixl_and_its_side_channel(nixl_pd: tuple[Worker, Worker]) -> None:
    p, d = nixl_pd
    assert httpx.get(f"{p.url}/splitserve/info", timeout=5).status_code == 401
    for w, role in ((p, "prefill"), (d, "decode")):
        info = httpx.get(f"{w.url}/splitserve/info", headers=auth_headers(), timeout=5).json()
        assert info["connector"] == "nixl" and info["role"] == role
        assert (info["kv_host"], info["kv_port"]) == ("127.0.0.1", w.kv_port)
        assert info["chat_format"] == "string" and len(info["chat_template_sha256"]) == 64
    assert p.kv_port != d.kv_port


def test_d_loads_every_prompt_block_and_stays_token_exact(nixl_pd: tuple[Worker, Worker]
                                                           ) -> None:
    """What D must be sent over NIXL: the prompt alone. D loads every prompt token P computed
    (whole blocks and a partial last one alike), recomputes only the last prompt token's logits,
    and emits t1 again, equal to P's. (Prompt + [t1] would need one block more than P sent
    whenever the prompt fills its last block; vLLM 0.32's D then fails an assertion and its
    engine dies.)"""
    p, d = nixl_pd
    model = Path(p.cfg.model)
    for i, n in enumerate((127, 128, 129, 256)):
        prompt = prompt_of(n, 50 + i)
        before = tokens_by_source(d)
        got = two_legs(p, d, prompt, MAX_TOKENS)
        assert got == hf_greedy(model, prompt, MAX_TOKENS), n
        after = tokens_by_source(d)
        loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        assert (loaded, computed) == (n, 0), (n, loaded, computed)


def test_concurrent_mixed_lengths_match_transformers(nixl_pd: tuple[Worker, Worker]) -> None:
    p, d = nixl_pd
    model = Path(p.cfg.model)
    prompts = [prompt_of(n, seed) for seed, n in enumerate(LENGTHS)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda pr: two_legs(p, d, pr, MAX_TOKENS), prompts))
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(model, prompt, MAX_TOKENS), len(prompt)
    wait_kv_free(p, d, timeout_s=15)


def test_chat_split_matches_transformers(nixl_pd: tuple[Worker, Worker]) -> None:
    p, d = nixl_pd
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What do the tides follow?"}]
    prompt = chat_prompt_ids(p.cfg.model, messages)
    answer = prefill_leg(p, [], "/v1/chat/completions", messages)
    assert answer["prompt_token_ids"] == prompt
    t1 = answer["choices"][0]["token_ids"][0]
    r = decode_leg(d, prompt, answer["kv_transfer_params"], MAX_TOKENS)
    got = r.json()["choices"][0]["token_ids"]
    assert got[0] == t1 and got == hf_greedy(Path(p.cfg.model), prompt, MAX_TOKENS)


def test_p_frees_blocks_no_d_reads_within_the_lease(nixl_pd: tuple[Worker, Worker]) -> None:
    """The client left between the legs: no D ever pulls, and P's blocks come back when the
    deployment's KV lease runs out (vLLM's `kv_lease_duration`, set from `--kv-lease`)."""
    p, d = nixl_pd
    wait_kv_free(p, d, timeout_s=15)
    start = time.monotonic()
    prefill_leg(p, prompt_of(600, 77))
    assert p.kv_usage() > 0  # held for a pull that never comes
    wait_kv_free(p, timeout_s=NIXL_LEASE_S + 20)
    assert time.monotonic() - start >= NIXL_LEASE_S * 0.5


def test_idle_nixl_worker_does_not_spin(nixl_pd: tuple[Worker, Worker],
                                        llama_pair: tuple[Worker, Worker]) -> None:
    """CPU time over a few idle seconds, against workers without NIXL on the same cores. With
    nixl's zero progress delay a worker burns ~1 core here (~50x a worker without NIXL)."""
    wait_kv_free(*nixl_pd, timeout_s=30)
    time.sleep(1.0)
    nixl_p, nixl_d, plain_p, plain_d = idle_cpu([*nixl_pd, *llama_pair], 4.0)
    plain = max(plain_p, plain_d, 0.01)
    assert max(nixl_p, nixl_d) < 5 * plain, (nixl_p, nixl_d, plain_p, plain_d)


def test_p_and_d_report_their_prefix_cache(nixl_pd: tuple[Worker, Worker]) -> None:
    """NIXL workers report their cache like splitserve's (issue 24): P the blocks it computed,
    D the blocks it pulled."""
    from splitserve.kvindex.keys import prefix_keys
    from splitserve.kvindex.messages import SNAPSHOT_PATH, KvSnapshot

    def keys(w: Worker) -> set[int]:
        r = httpx.get(f"{w.url}{SNAPSHOT_PATH}", headers=auth_headers(), timeout=10)
        snap = KvSnapshot.from_json(r.json())
        assert snap.exact and snap.block_size == 128
        return set(snap.keys)

    p, d = nixl_pd
    for w in (p, d):
        info = httpx.get(f"{w.url}/splitserve/info", headers=auth_headers(), timeout=5).json()
        assert (info["kv_events"], info["block_size"]) == (True, 128)
    prompt = prompt_of(300, 2024)
    two_legs(p, d, prompt, 2)
    want = set(prefix_keys(prompt, 128))
    deadline = time.monotonic() + 20
    while not (want <= keys(p) and want <= keys(d)):
        assert time.monotonic() < deadline, "the prompt's blocks were not reported"
        time.sleep(0.2)
