"""What vLLM's NixlConnector skips when D's prefix cache already holds part of the prompt: D
allocates blocks only for the prompt's uncached suffix and pulls only those of P's blocks
(`_apply_prefix_caching` end-trims P's `remote_block_ids` to D's count); P still computed and
holds every block until D's notice. The same prompt shape with and without a primed D: tokens by
source, and NIXL's own byte count."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.nixl_helpers import tokens_by_source, two_legs
from tests.support.workers import Worker, auth_headers, hf_greedy, model_name

MAX_TOKENS = 6
N, PRIMED = 600, 256  # 5 blocks of 128 (the last partial); D holds the first 2


def prompt_of(length: int, seed: int) -> list[int]:
    return [5 + (seed * 41 + i * 19) % 1000 for i in range(length)]


def nixl_bytes(w: Worker) -> float:
    """The sum of `vllm:nixl_bytes_transferred` (bytes each transfer read), or -1 if absent."""
    text = httpx.get(f"{w.url}/metrics", headers=auth_headers(), timeout=5).text
    sums = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:nixl_bytes_transferred_sum")]
    return sum(sums) if sums else -1.0


def pull(p: Worker, d: Worker, prompt: list[int]) -> tuple[dict[str, float], float]:
    """Both legs; D's prompt tokens by source and NIXL's bytes, as deltas of this request."""
    before, bytes_before = tokens_by_source(d), nixl_bytes(d)
    got = two_legs(p, d, prompt, MAX_TOKENS)
    assert got == hf_greedy(Path(p.cfg.model), prompt, MAX_TOKENS)
    after = tokens_by_source(d)
    return {k: after[k] - before[k] for k in after}, nixl_bytes(d) - bytes_before


def test_d_pulls_only_the_blocks_its_prefix_cache_lacks(nixl_pd: tuple[Worker, Worker]) -> None:
    p, d = nixl_pd
    cold, cold_bytes = pull(p, d, prompt_of(N, 90))
    primed = prompt_of(N, 91)
    r = httpx.post(f"{d.url}/v1/completions", headers=auth_headers(), timeout=120,
                   json={"model": model_name(d), "prompt": primed[:PRIMED], "max_tokens": 1})
    r.raise_for_status()
    warm, warm_bytes = pull(p, d, primed)
    assert (cold["local_cache_hit"], cold["external_kv_transfer"]) == (0, N), cold
    assert (warm["local_cache_hit"], warm["external_kv_transfer"]) == (PRIMED, N - PRIMED), warm
    if cold_bytes >= 0:  # NIXL reads whole blocks: 3 of 5 once D holds 2
        assert warm_bytes * 5 == cold_bytes * 3, (warm_bytes, cold_bytes)
    print(f"NIXL bytes pulled for a {N}-token prompt: {cold_bytes:.0f} cold, {warm_bytes:.0f} "
          f"with D holding its first {PRIMED} tokens; tokens by source {cold} / {warm}")
