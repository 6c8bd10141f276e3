"""Every message between the router and a worker's `/splitserve/*` routes, as frozen, validated
types. The worker builds them and serves `to_json()`; the router (and the benchmark) parse each
answer once with `from_json`, which raises `WireError` naming the field on anything malformed,
so nothing downstream reads a raw dict.

Routes and their types:
- `GET /splitserve/info`: `WorkerInfo` (the worker's connector, role and KV endpoint);
- `GET /splitserve/load`: `WorkerLoad` (the vLLM gauges the router routes by);
- `GET /splitserve/state`: `ConnectorState` (staging, pending loads, held sends, counters);
- `GET /splitserve/transfers/{id}`: `TransferRecord` (each side's `SideRecord` of a transfer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, Self, TypeVar

from splitserve.common.vocab import Connector, Role, TransferStatus


class WireError(ValueError):
    """A worker's answer does not have the shape its route promises."""


def _obj(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise WireError(f"{what} must be a JSON object, got {type(raw).__name__}")
    return raw


def _num(raw: dict[str, Any], key: str, what: str, default: float | None = 0.0
         ) -> float | None:
    value = raw.get(key, default)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return None if value is None else float(value)
    raise WireError(f"{what}.{key} must be a number, got {value!r}")


def _int(raw: dict[str, Any], key: str, what: str, default: int | None = 0) -> int | None:
    value = raw.get(key, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise WireError(f"{what}.{key} must be an integer, got {value!r}")


def _str(raw: dict[str, Any], key: str, what: str) -> str | None:
    value = raw.get(key)
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{what}.{key} must be a string, got {value!r}")


E = TypeVar("E", bound=StrEnum)


def _enum(cls: type[E], value: Any, what: str) -> E:
    try:
        return cls(value)
    except ValueError:
        raise WireError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}"
                        ) from None


@dataclass(frozen=True)
class WorkerInfo:
    """`GET /splitserve/info`: which connector a worker runs, its role, and its KV endpoint
    (splitserve: the KV listener; nixl: vLLM's NIXL side channel). `kv_port` None: no endpoint.
    """

    connector: Connector
    role: Role
    transport: str | None = None  # splitserve: tcp | shm; nixl: "nixl"
    kv_host: str | None = None
    kv_port: int | None = None
    kv_tls: bool = False
    engine_id: str | None = None
    model_fingerprint: dict[str, Any] | None = None  # splitserve: what P and D must share
    vllm_version: str | None = None
    progress_delay_us: int | None = None  # nixl: the progress thread's poll timeout

    def __post_init__(self) -> None:
        if self.kv_port is not None and not 0 < self.kv_port < 65536:
            raise WireError(f"info.kv_port must be a port number, got {self.kv_port}")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "info")
        fp = raw.get("model_fingerprint")
        if fp is not None and not isinstance(fp, dict):
            raise WireError("info.model_fingerprint must be an object")
        return cls(connector=_enum(Connector, raw.get("connector") or Connector.SPLITSERVE,
                                   "info.connector"),
                   role=_enum(Role, raw.get("role"), "info.role"),
                   transport=_str(raw, "transport", "info"),
                   kv_host=_str(raw, "kv_host", "info"),
                   kv_port=_int(raw, "kv_port", "info", None),
                   kv_tls=bool(raw.get("kv_tls", False)),
                   engine_id=_str(raw, "engine_id", "info"),
                   model_fingerprint=fp, vllm_version=_str(raw, "vllm_version", "info"),
                   progress_delay_us=_int(raw, "progress_delay_us", "info", None))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items()
                if v is not None or k in ("kv_host", "kv_port")}


@dataclass(frozen=True)
class WorkerLoad:
    """`GET /splitserve/load` (or the same gauges parsed from a plain worker's `/metrics`):
    vLLM's KV cache usage (0..1) and its running and waiting requests. A gauge the engine has
    not published yet is None."""

    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "load")
        return cls(**{f.name: _num(raw, f.name, "load", None) for f in fields(cls)})

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TransferCounters:
    """A worker's transfer counters since start: `counts` by "<side>_<status>", `failures` by
    cause, and the bytes and seconds of completed transfers by side."""

    counts: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    bytes_total: dict[str, int] = field(default_factory=dict)
    seconds_total: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "state.transfers")
        out: dict[str, dict[str, Any]] = {}
        for f in fields(cls):
            table = _obj(raw.get(f.name, {}), f"state.transfers.{f.name}")
            out[f.name] = {str(k): _num(table, k, f"state.transfers.{f.name}")
                           for k in table}
            if f.name != "seconds_total":
                out[f.name] = {k: int(v) for k, v in out[f.name].items()}
        return cls(**out)


@dataclass(frozen=True)
class ConnectorState:
    """`GET /splitserve/state`: a splitserve-connector worker's identity (as in `WorkerInfo`)
    plus what it holds now. Every count is zero on a drained worker."""

    info: WorkerInfo
    staged_bytes: int = 0
    staging_capacity_bytes: int = 0
    staging_free_bytes: int = 0
    open_leases: int = 0
    claimed_transfers: int = 0
    pending_loads: int = 0
    held_sends: int = 0
    transfers: TransferCounters = field(default_factory=TransferCounters)

    COUNTS = ("staged_bytes", "staging_capacity_bytes", "staging_free_bytes", "open_leases",
              "claimed_transfers", "pending_loads", "held_sends")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "state")
        counts = {k: _int(raw, k, "state") for k in cls.COUNTS}
        return cls(info=WorkerInfo.from_json(raw), **counts,  # type: ignore[arg-type]
                   transfers=TransferCounters.from_json(raw.get("transfers", {})))

    def to_json(self) -> dict[str, Any]:
        return {**self.info.to_json(), **{k: getattr(self, k) for k in self.COUNTS},
                "transfers": asdict(self.transfers)}


@dataclass(frozen=True)
class SideRecord:
    """One worker's record of one transfer (`side` "send" on P, "recv" on D). Times are epoch
    seconds on that worker's clock; derived: `duration_s` (BEGIN to verified END), `tail_s`
    (what the overlap with P's prefill leaves exposed), `gbps` (bytes / `wire_s`)."""

    transfer_id: str
    side: str
    status: TransferStatus
    tokens: int = 0
    bytes: int = 0
    cause: str | None = None
    started_s: float | None = None
    first_byte_s: float | None = None
    complete_s: float | None = None
    load_s: float | None = None
    loaded_tokens: int | None = None
    load_mode: str | None = None
    copy_forward_s: float = 0.0
    sender_layers_s: float = 0.0
    sender_sends_s: float = 0.0
    last_layer_s: float | None = None
    end_lag_s: float | None = None
    end_received_s: float | None = None
    wire_s: float | None = None
    duration_s: float | None = None
    tail_s: float | None = None
    gbps: float | None = None

    def __post_init__(self) -> None:
        if self.side not in ("send", "recv"):
            raise WireError(f"record.side must be send or recv, got {self.side!r}")

    @property
    def final(self) -> bool:
        return self.status.terminal

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "record")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in ("transfer_id", "side", "status") or f.name not in raw:
                continue
            if f.type in ("int", "int | None"):
                kw[f.name] = _int(raw, f.name, "record", None)
            elif f.type in ("str | None",):
                kw[f.name] = _str(raw, f.name, "record")
            else:
                kw[f.name] = _num(raw, f.name, "record", None)
        return cls(transfer_id=str(raw.get("transfer_id") or ""), side=str(raw.get("side")),
                   status=_enum(TransferStatus, raw.get("status"), "record.status"),
                   **{k: v for k, v in kw.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TransferRecord:
    """`GET /splitserve/transfers/{id}`: what this worker recorded of one transfer, per side."""

    transfer_id: str
    recv: SideRecord | None = None
    send: SideRecord | None = None

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "transfer")
        sides = {s: SideRecord.from_json(raw[s]) for s in ("recv", "send")
                 if raw.get(s) is not None}
        return cls(transfer_id=str(raw.get("transfer_id") or ""), **sides)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"transfer_id": self.transfer_id}
        for side in ("recv", "send"):
            rec = getattr(self, side)
            if rec is not None:
                out[side] = rec.to_json()
        return out
