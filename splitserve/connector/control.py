"""The control queries a worker's listener answers (behind `/splitserve/*` and `/metrics`):
the connector's state (`wire.ConnectorState`), one transfer's record (`wire.TransferRecord`),
or discarding a staged transfer. Runs on the listener's connection threads; reads counters the
engine thread updates. The QUERY's ANSWER frame carries each as its `to_json()`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from splitserve.common import wire
from splitserve.common.vocab import Connector, Role
from splitserve.config import ConnectorConfig
from splitserve.connector.messages import Query
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats

UNKNOWN_TRANSFER = {"error": "unknown transfer"}


class ControlAnswers:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, vllm_version: str,
                 fingerprint: Fingerprint, stats: ConnectorStats, staging: StagingArea | None,
                 pending_loads: Callable[[], int], held_sends: Callable[[], int]) -> None:
        self._stats, self._staging = stats, staging
        self._pending_loads, self._held_sends = pending_loads, held_sends
        self.info = wire.WorkerInfo(
            connector=Connector.SPLITSERVE, role=Role(cfg.role), transport=cfg.transport,
            kv_host=cfg.kv_host, kv_port=cfg.kv_port or None, kv_tls=cfg.tls_enabled,
            engine_id=engine_id, model_fingerprint=asdict(fingerprint),
            vllm_version=vllm_version)

    def state(self) -> wire.ConnectorState:
        """What this worker holds now (every count zero when drained), with its identity."""
        staging = self._staging.state() if self._staging else {}
        return wire.ConnectorState(info=self.info, **staging,
                                   pending_loads=self._pending_loads(),
                                   held_sends=self._held_sends(),
                                   transfers=self._stats.snapshot())

    def transfer(self, transfer_id: str) -> wire.TransferRecord | None:
        """This worker's records of one transfer, or None if it has none (any more)."""
        return self._stats.record(transfer_id)

    def answer(self, query: Query) -> dict[str, Any]:
        """The listener's QUERY handler: the state's or the record's JSON (`UNKNOWN_TRANSFER`
        for a record this worker does not hold), or `{"discarded": bool}`."""
        if query.what == "transfer":
            rec = self.transfer(query.transfer_id or "")
            return rec.to_json() if rec is not None else dict(UNKNOWN_TRANSFER)
        if query.what == "discard":
            if self._staging is None:
                return {"error": "not a decode worker"}
            return {"discarded": self._staging.discard(query.transfer_id or "")}
        return self.state().to_json()
