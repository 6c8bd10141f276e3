"""A worker's load on the wire: `GET /splitserve/load` on every splitserve worker (served by
`worker.load.read_load`), read by the router's health loop (it routes by it) and by the
benchmark's busy sampler. A plain vLLM worker has no such route (404): its `/metrics` page is
parsed for the same keys (`parse_metrics`).
"""

from __future__ import annotations

LOAD_PATH = "/splitserve/load"
# vLLM gauge -> key in `/splitserve/load` (and the router's `Worker` field of that name)
LOAD_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The `/splitserve/load` keys out of a vLLM `/metrics` page (a plain vLLM worker), each
    gauge summed over its label sets; gauges the page lacks are absent."""
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
