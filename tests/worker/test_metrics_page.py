"""The worker's `/metrics` page (`metrics_page.metrics_app`): prometheus_client's exposition,
with every collector run off the event loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from splitserve.worker.metrics_page import metrics_app


class Recorded:
    """A collector that notes the thread it runs on (as a rank query would block it)."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self) -> Iterator[Metric]:
        self.threads.append(threading.get_ident())
        for name in ("splitserve_kv_up", "splitserve_kv_other"):
            g = GaugeMetricFamily(name, "a gauge")
            g.add_metric([], 1.0)
            yield g


async def test_collectors_run_off_the_loop_and_the_page_is_prometheus_exposition() -> None:
    registry = CollectorRegistry(auto_describe=True)  # as prometheus_client's default
    collector = Recorded()
    registry.register(collector)
    collector.threads.clear()  # register() collects once to learn the names
    transport = httpx.ASGITransport(app=metrics_app(registry))
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
        plain = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
        assert plain.status_code == 200 and plain.headers["content-type"].startswith(
            "text/plain")
        assert "splitserve_kv_up 1.0" in plain.text
        assert collector.threads and threading.get_ident() not in collector.threads
        zipped = await client.get("/metrics", headers={"Accept-Encoding": "gzip"})
        assert zipped.headers["content-encoding"] == "gzip"
        assert zipped.text == plain.text  # as httpx decodes it
        one = await client.get("/metrics?name[]=splitserve_kv_other",
                               headers={"Accept": "application/openmetrics-text"})
        assert one.headers["content-type"].startswith("application/openmetrics-text")
        assert "splitserve_kv_other" in one.text and "splitserve_kv_up" not in one.text
        assert one.text.endswith("# EOF\n")
