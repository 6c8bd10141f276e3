"""A worker's connector ranks as one: each tensor-parallel rank's control channel (rank r's
connector listens on `kv_port + r`), the worker's state as their sum, and the Prometheus
collector over it (`splitserve_kv_*`)."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from splitserve.common.wire import ConnectorState, WireError
from splitserve.config import ConnectorConfig
from splitserve.connector.framing import ProtocolError
from splitserve.connector.messages import Query
from splitserve.connector.protocol import query
from splitserve.connector.tls import client_context

GAUGES = {
    "staged_bytes": "KV bytes staged on this worker, not yet loaded",
    "staging_capacity_bytes": "size of the staging area",
    "open_leases": "staged transfers not yet claimed by a decode request",
    "pending_loads": "decode requests waiting for their KV",
    "held_sends": "prefill requests whose blocks are held until the decode worker acknowledges",
}



def tensor_parallel_size(args: Namespace | None) -> int:
    """The worker's ranks (vLLM's `--tensor-parallel-size`); rank r's connector listens on
    `kv_port + r`."""
    return int(getattr(args, "tensor_parallel_size", None) or 1)


class RankListeners:
    """The control channels of a worker's connector, one a tensor-parallel rank."""

    def __init__(self, cfg: ConnectorConfig, token: str, ranks: int) -> None:
        self.cfg, self.token, self.ranks = cfg, token, ranks
        self.tls = client_context(cfg)  # the listener speaks TLS whenever it is configured

    def ask(self, question: Query, timeout_s: float, every_rank: bool = True
            ) -> list[dict[str, Any]]:
        """Every rank's answer, rank 0's first (`every_rank` False: rank 0's alone); raises
        (OSError, ProtocolError) if one does not answer."""
        ranks = self.ranks if every_rank else 1
        return [query(self.cfg.kv_host, self.cfg.kv_port + r, self.token, question, timeout_s,
                      self.tls) for r in range(ranks)]

    def state(self, timeout_s: float) -> ConnectorState:
        """The worker's state: its ranks' summed."""
        return summed(self.ask(Query("state"), timeout_s))


def summed(answers: list[dict[str, Any]]) -> ConnectorState:
    """The ranks' state answers (rank 0's first) as the worker's (`ConnectorState.of_ranks`)."""
    return ConnectorState.of_ranks([ConnectorState.from_json(raw) for raw in answers])


class ConnectorCollector:
    """Prometheus collector that reads the connector's state (`ConnectorState`, every rank's
    summed) at scrape time; `splitserve_kv_listener_up` is 0 when a rank's connector does not
    answer, or not in shape."""

    def __init__(self, listeners: RankListeners) -> None:
        self.listeners = listeners

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("splitserve_kv_listener_up", "connector control channel answers")
        try:
            state = self.listeners.state(1.0)
        except (OSError, ProtocolError, WireError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for key, doc in GAUGES.items():
            g = GaugeMetricFamily(f"splitserve_kv_{key}", doc)
            g.add_metric([], float(getattr(state, key)))
            yield g
        t = state.transfers
        transfers = CounterMetricFamily("splitserve_kv_transfers", "transfers by side and status",
                                        labels=["side", "status"])
        for name, n in t.counts.items():
            side, _, status = name.partition("_")
            transfers.add_metric([side, status], n)
        yield transfers
        failures = CounterMetricFamily("splitserve_kv_failures", "transfer failures by cause",
                                       labels=["cause"])
        for cause, n in t.failures.items():
            failures.add_metric([cause], n)
        yield failures
        nbytes = CounterMetricFamily("splitserve_kv_bytes", "bytes of completed transfers",
                                     labels=["side"])
        secs = CounterMetricFamily("splitserve_kv_transfer_seconds",
                                   "seconds spent in completed transfers (bytes/seconds = GB/s)",
                                   labels=["side"])
        for side, n in t.bytes_total.items():
            nbytes.add_metric([side], n)
        for side, s in t.seconds_total.items():
            secs.add_metric([side], s)
        yield nbytes
        yield secs
