"""The control queries a worker's listener answers (behind `/splitserve/*` and `/metrics`):
the connector's state, one transfer's record, or discarding a staged transfer. Runs on the
listener's connection threads; reads counters the engine thread updates."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from splitserve.config import ConnectorConfig
from splitserve.connector.messages import Query
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats

EMPTY_STAGING = MappingProxyType({"staged_bytes": 0, "staging_capacity_bytes": 0,
                                  "staging_free_bytes": 0, "open_leases": 0,
                                  "claimed_transfers": 0})


class ControlAnswers:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, vllm_version: str,
                 fingerprint: Fingerprint, stats: ConnectorStats, staging: StagingArea | None,
                 pending_loads: Callable[[], int], held_sends: Callable[[], int]) -> None:
        self._cfg, self._engine_id, self._vllm_version = cfg, engine_id, vllm_version
        self._fingerprint, self._stats, self._staging = fingerprint, stats, staging
        self._pending_loads, self._held_sends = pending_loads, held_sends

    def answer(self, query: Query) -> dict[str, Any]:
        """The listener's QUERY handler: state, or one transfer's record."""
        if query.what == "transfer":
            rec = self._stats.record(query.transfer_id or "")
            return rec if rec is not None else {"error": "unknown transfer"}
        if query.what == "discard":
            if self._staging is None:
                return {"error": "not a decode worker"}
            return {"discarded": self._staging.discard(query.transfer_id or "")}
        staging = self._staging.state() if self._staging else EMPTY_STAGING
        cfg = self._cfg
        return {
            "role": cfg.role, "transport": cfg.transport, "kv_host": cfg.kv_host,
            "kv_port": cfg.kv_port, "kv_tls": cfg.tls_enabled, "engine_id": self._engine_id,
            "model_fingerprint": self._fingerprint.__dict__,
            "vllm_version": self._vllm_version, **staging,
            "pending_loads": self._pending_loads(), "held_sends": self._held_sends(),
            "transfers": self._stats.snapshot(),
        }
