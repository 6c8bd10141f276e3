"""Prompt tokens computed against cached, as the servers report them.

Per request (`prefix_cache_stats`): vLLM's completions `usage.prompt_tokens_details.
cached_tokens`, sent when the server runs with `--enable-prompt-tokens-details` (the prompt
tokens the answering engine did not compute: its prefix-cache hits plus KV loaded through a
connector). Over the successful requests that reported it: `cached_prompt_tokens`,
`computed_prompt_tokens` (their prompt tokens − cached) and `prefix_hit_rate` (cached / prompt
tokens); all null when no request reported it. Behind a P/D router the figure is what the
router passes on from the engine that answered.

Per worker (`read_prompt_sources` at the run's start and stop, `source_deltas`): vLLM's counter
`vllm:prompt_tokens_by_source` (always on) split into `computed` (`local_compute`), `cache_hit`
(`local_cache_hit`) and `loaded` (`external_kv_transfer`: KV that came through a connector),
over the run, with the worker's `hit_rate` = cache_hit / all three.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from splitserve.bench.client import RequestRecord
from splitserve.config import bearer_headers

PROMPT_SOURCES = "vllm:prompt_tokens_by_source_total"
SOURCE_NAMES = {"local_compute": "computed", "local_cache_hit": "cache_hit",
                "external_kv_transfer": "loaded"}


def prefix_cache_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The result JSON's per-request cache keys (see the module docstring)."""
    told = [r for r in records if r.ok and r.cached_tokens is not None]
    prompt = sum(r.input_len for r in told)
    cached = sum(int(r.cached_tokens or 0) for r in told)
    return {"cache_reported_requests": len(told),
            "cached_prompt_tokens": cached if told else None,
            "computed_prompt_tokens": prompt - cached if told else None,
            "prefix_hit_rate": cached / prompt if told and prompt else None}


def parse_prompt_sources(metrics_text: str) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source` per source (our names), summed over engines."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(PROMPT_SOURCES + "{"):
            continue
        labels, _, value = line[len(PROMPT_SOURCES) + 1:].rpartition("} ")
        for part in labels.split(","):
            key, _, val = part.partition("=")
            if key.strip() == "source" and val.strip('"') in SOURCE_NAMES:
                name = SOURCE_NAMES[val.strip('"')]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
    return out


async def read_prompt_sources(worker_urls: Mapping[str, str], token: str | None = None
                              ) -> dict[str, dict[str, float]]:
    """Each worker's counters now (workers that do not answer, or lack it, are left out)."""
    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=5.0, headers=bearer_headers(token)) as client:
        for name, url in worker_urls.items():
            try:
                resp = await client.get(f"{url.rstrip('/')}/metrics")
            except httpx.HTTPError:
                continue
            if resp.status_code == 200 and (found := parse_prompt_sources(resp.text)):
                out[name] = found
    return out


def source_deltas(before: Mapping[str, Mapping[str, float]],
                  after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per worker read at both ends: the run's computed / cache-hit / loaded prompt tokens and
    its hit rate (null when it saw no prompt tokens)."""
    out: dict[str, dict[str, Any]] = {}
    for name, end in after.items():
        if name not in before:
            continue
        d: dict[str, Any] = {k: end.get(k, 0.0) - before[name].get(k, 0.0)
                             for k in SOURCE_NAMES.values()}
        total = sum(d.values())
        d["hit_rate"] = d["cache_hit"] / total if total > 0 else None
        out[name] = d
    return out
