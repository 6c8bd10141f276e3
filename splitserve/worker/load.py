"""A worker's load as the router routes by: `GET /splitserve/load` on every splitserve worker.

The same three vLLM gauges the router would otherwise parse out of `/metrics`, read from vLLM's
registry restricted to those names: rendering the whole `/metrics` page costs the API server
~4 ms of CPU on the engine's core (measured on the demo model), once per health round.
"""

from __future__ import annotations

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
