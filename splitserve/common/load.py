"""A worker's load on the wire: `GET /splitserve/load` on every splitserve worker (a
`wire.WorkerLoad`, served by `worker.load.read_load`), read by the router's health loop (it
routes by it) and by the benchmark's busy sampler. A plain vLLM worker has no such route (404):
its `/metrics` page is parsed into the same type (`parse_metrics`).
"""

from __future__ import annotations

from splitserve.common.wire import WorkerLoad

LOAD_PATH = "/splitserve/load"
# vLLM gauge -> `WorkerLoad` field (and key in `/splitserve/load`)
LOAD_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


def gauges_load(samples: dict[str, float]) -> WorkerLoad:
    """The load from vLLM gauge values by gauge name (`LOAD_GAUGES`' keys); others ignored."""
    return WorkerLoad(**{LOAD_GAUGES[name]: v for name, v in samples.items()
                         if name in LOAD_GAUGES})


def parse_metrics(text: str) -> WorkerLoad:
    """The load out of a vLLM `/metrics` page (a plain vLLM worker), each gauge summed over its
    label sets; a gauge the page lacks is None."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if name not in LOAD_GAUGES:
            continue
        try:
            value = float(rest.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return gauges_load(sums)
