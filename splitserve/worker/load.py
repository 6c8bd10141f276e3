"""A worker's load: `GET /splitserve/load` on every splitserve worker, read by the router's
health loop (it routes by it) and by the benchmark's busy sampler.

The same three vLLM gauges the router would otherwise parse out of `/metrics`, read from vLLM's
registry restricted to those names: rendering the whole `/metrics` page costs the API server
~4 ms of CPU on the engine's core (measured on the demo model), once per health round and per
busy sample. A plain vLLM worker has no such route (404): its `/metrics` page is parsed for the
same keys (`parse_metrics`).
"""

from __future__ import annotations

LOAD_PATH = "/splitserve/load"
# vLLM gauge -> key in `/splitserve/load` (and the router's `Worker` field of that name)
LOAD_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


def read_load() -> dict[str, float]:
    """Each gauge summed over its label sets (one engine per worker); no other family is
    collected."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    out: dict[str, float] = {}
    for family in get_prometheus_registry().restricted_registry(list(LOAD_GAUGES)).collect():
        for sample in family.samples:
            key = LOAD_GAUGES.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """The same keys out of a vLLM `/metrics` page (a plain vLLM worker), each gauge summed
    over its label sets; gauges the page lacks are absent."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        key = LOAD_GAUGES.get(name)
        if key is None:
            continue
        try:
            value = float(rest.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[key] = out.get(key, 0.0) + value
    return out
