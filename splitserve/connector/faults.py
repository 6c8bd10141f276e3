"""Test-only fault injection, read in one place.

Off unless the worker's environment sets `SPLITSERVE_FAULTS=1`. When on, a transfer whose id
contains one of the markers below misbehaves on the prefill side, so tests can exercise real
failures on a shared deployment:

| marker in transfer_id | effect |
|---|---|
| `fault-corrupt`  | layer 1's checksum is sent wrong (D sees corrupt data) |
| `fault-drop`     | nothing is pushed at all (the transfer never arrives) |
| `fault-short`    | the last layer is not pushed, END is (a short transfer) |
| `fault-delay`    | each layer is pushed 0.2 s late |
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitserve.config import FAULTS_ENV


@dataclass(frozen=True)
class Faults:
    enabled: bool

    @classmethod
    def from_env(cls) -> Faults:
        return cls(enabled=os.environ.get(FAULTS_ENV, "") == "1")

    def _has(self, transfer_id: str, marker: str) -> bool:
        return self.enabled and marker in transfer_id

    def corrupt_layer(self, transfer_id: str, layer: int) -> bool:
        return layer == 1 and self._has(transfer_id, "fault-corrupt")

    def drop(self, transfer_id: str) -> bool:
        return self._has(transfer_id, "fault-drop")

    def skip_layer(self, transfer_id: str, layer: int, num_layers: int) -> bool:
        return layer == num_layers - 1 and self._has(transfer_id, "fault-short")

    def delay_s(self, transfer_id: str) -> float:
        return 0.2 if self._has(transfer_id, "fault-delay") else 0.0
