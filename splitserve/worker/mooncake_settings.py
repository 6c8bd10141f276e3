"""How splitserve runs vLLM's MooncakeConnector on a worker: the settings that travel in
`kv_connector_extra_config["splitserve_mooncake"]` (read by the plugin for `/splitserve/info`;
importable without vLLM), and the transfer protocol a worker uses by default."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from splitserve.common.vocab import Role, values

EXTRA_KEY = "splitserve_mooncake"
PROTOCOLS = ("tcp", "rdma")
INFINIBAND = "/sys/class/infiniband"


def default_protocol(devices: str = INFINIBAND) -> str:
    """`rdma` where the machine has an RDMA device (`/sys/class/infiniband` lists one), else
    `tcp`, which every machine has."""
    try:
        return "rdma" if os.listdir(devices) else "tcp"
    except OSError:
        return "tcp"


@dataclass(frozen=True)
class MooncakeSettings:
    """`role`: the worker's role in the deployment (advertised in `/splitserve/info`; Mooncake
    itself runs `kv_both`). `protocol`: the Mooncake transfer engine's protocol (`tcp`, `rdma`).
    `bootstrap_port`: where P's bootstrap server answers `GET /query` with its engine id and
    its ranks' addresses (vLLM reads it from `VLLM_MOONCAKE_BOOTSTRAP_PORT`)."""

    role: Role = Role.BOTH
    protocol: str = "tcp"
    bootstrap_port: int = 8998

    def __post_init__(self) -> None:
        if self.role not in values(Role):
            raise ValueError(f"role must be one of {values(Role)}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {PROTOCOLS}, "
                             f"got {self.protocol!r}")
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be a port, got {self.bootstrap_port}")

    @classmethod
    def present(cls, extra: dict[str, Any] | None) -> bool:
        return bool(extra) and EXTRA_KEY in extra  # type: ignore[operator]

    def to_extra_config(self) -> dict[str, Any]:
        return {EXTRA_KEY: {**asdict(self), "role": self.role.value},
                "mooncake_protocol": self.protocol}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> MooncakeSettings:
        return cls(**((extra or {}).get(EXTRA_KEY) or {}))
