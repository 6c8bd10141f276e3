"""A worker's load: what it answers on `GET /splitserve/load` (a `wire.WorkerLoad`; the route and
the gauges are in `common.load`, which the router's health loop and the benchmark's busy sampler
read).

The same three vLLM gauges the router would otherwise parse out of `/metrics`, read from vLLM's
registry restricted to those names: rendering the whole `/metrics` page costs the API server
~4 ms of CPU on the engine's core (measured on the demo model), once per health round and per
busy sample. A plain vLLM worker has no such route (404): its `/metrics` page is parsed into the
same type (`parse_metrics`).
"""

from __future__ import annotations

from splitserve.common.load import LOAD_GAUGES, LOAD_PATH, gauges_load, parse_metrics
from splitserve.common.wire import WorkerLoad

__all__ = ["LOAD_GAUGES", "LOAD_PATH", "parse_metrics", "read_load"]


def read_load() -> WorkerLoad:
    """Each gauge summed over its label sets (one engine per worker); no other family is
    collected. A gauge vLLM has not registered yet is None."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    sums: dict[str, float] = {}
    for family in get_prometheus_registry().restricted_registry(list(LOAD_GAUGES)).collect():
        for sample in family.samples:
            if sample.name in LOAD_GAUGES:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    return gauges_load(sums)
