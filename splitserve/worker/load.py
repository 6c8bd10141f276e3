"""A worker's load: what it answers on `GET /splitserve/load` (the route and its keys are in
`common.load`, which the router's health loop and the benchmark's busy sampler read).

The same three vLLM gauges the router would otherwise parse out of `/metrics`, read from vLLM's
registry restricted to those names: rendering the whole `/metrics` page costs the API server
~4 ms of CPU on the engine's core (measured on the demo model), once per health round and per
busy sample. A plain vLLM worker has no such route (404): its `/metrics` page is parsed for the
same keys (`parse_metrics`).
"""

from __future__ import annotations

from splitserve.common.load import LOAD_GAUGES, LOAD_PATH, parse_metrics

__all__ = ["LOAD_GAUGES", "LOAD_PATH", "parse_metrics", "read_load"]


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
