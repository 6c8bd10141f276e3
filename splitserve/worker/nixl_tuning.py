"""How splitserve runs vLLM's NixlConnector on a worker: the settings that travel in
`kv_connector_extra_config["splitserve_nixl"]` (read by `splitserve.worker.nixl` in the engine;
importable without vLLM)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from splitserve.common.vocab import Role, values
from splitserve.config import NIXL_PROGRESS_DELAY_US

EXTRA_KEY = "splitserve_nixl"


@dataclass(frozen=True)
class NixlTuning:
    """`role`: the worker's role in the deployment (advertised in `/splitserve/info`; NIXL itself
    runs `kv_both`). `progress_delay_us`: the NIXL progress thread's poll timeout (0 is nixl's own
    busy spin). `keep_affinity`: the forward thread keeps the worker's cores (False leaves vLLM's
    move of it onto the last core of each NUMA node)."""

    role: Role = Role.BOTH
    progress_delay_us: int = NIXL_PROGRESS_DELAY_US
    keep_affinity: bool = True

    def __post_init__(self) -> None:
        if self.role not in values(Role):
            raise ValueError(f"role must be one of {values(Role)}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))
        if self.progress_delay_us < 0:
            raise ValueError("progress_delay_us must not be negative")

    @classmethod
    def present(cls, extra: dict[str, Any] | None) -> bool:
        return bool(extra) and EXTRA_KEY in extra  # type: ignore[operator]

    def to_extra_config(self) -> dict[str, Any]:
        return {EXTRA_KEY: {**asdict(self), "role": self.role.value}}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> NixlTuning:
        return cls(**((extra or {}).get(EXTRA_KEY) or {}))
