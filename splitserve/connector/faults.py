"""Test-only fault injection, read in one place.

Off unless the worker's environment sets `SPLITSERVE_FAULTS`: `1` enables the transfer faults,
`1,crash` (or `crash`) also the crash points. When on, a transfer whose id contains one of the
markers below misbehaves, so tests exercise real failures on a shared deployment. The router puts
the client's `X-Request-Id` into every transfer id, so a client chooses faults per request:

| marker in transfer_id | effect |
|---|---|
| `fault-corrupt`  | layer 1's checksum is sent wrong (D sees corrupt data) |
| `fault-drop`     | nothing is pushed at all (the transfer never arrives) |
| `fault-short`    | the last layer is not pushed, END is (a short transfer) |
| `fault-delay`    | each layer is pushed 0.2 s late |
| `fault-crash-p`  | crash points on: the prefill worker dies (SIGKILL, whole process group)
|                  | mid-push, before its middle layer |
| `fault-crash-d`  | crash points on: the decode worker dies when the transfer's BEGIN arrives |
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from splitserve.config import FAULTS_ENV


@dataclass(frozen=True)
class Faults:
    enabled: bool
    crashes: bool = False

    @classmethod
    def from_env(cls) -> Faults:
        parts = set(os.environ.get(FAULTS_ENV, "").split(","))
        return cls(enabled=bool(parts & {"1", "crash"}), crashes="crash" in parts)

    def _has(self, transfer_id: str, marker: str) -> bool:
        return self.enabled and marker in transfer_id

    def marks(self, transfer_id: str) -> bool:
        """The transfer asks for some fault (its layers then take the sender thread's path)."""
        return self._has(transfer_id, "fault-")

    def corrupt_layer(self, transfer_id: str, layer: int) -> bool:
        return layer == 1 and self._has(transfer_id, "fault-corrupt")

    def drop(self, transfer_id: str) -> bool:
        return self._has(transfer_id, "fault-drop")

    def skip_layer(self, transfer_id: str, layer: int, num_layers: int) -> bool:
        return layer == num_layers - 1 and self._has(transfer_id, "fault-short")

    def delay_s(self, transfer_id: str) -> float:
        return 0.2 if self._has(transfer_id, "fault-delay") else 0.0

    def crash_if(self, transfer_id: str, point: str, layer: int = 0, num_layers: int = 0) -> None:
        """Kill this worker — its whole process group, as a machine failure would — at `point`
        (`p-mid-push` at the middle layer, `d-begin`) if the transfer asks for it."""
        if not self.crashes:
            return
        if (point == "p-mid-push" and layer == num_layers // 2
                and self._has(transfer_id, "fault-crash-p")) or (
                point == "d-begin" and self._has(transfer_id, "fault-crash-d")):
            os.killpg(os.getpgrp(), signal.SIGKILL)
