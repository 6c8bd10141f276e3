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

import math
import typing
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from functools import cache
from typing import Any, ClassVar, Self, TypeVar

from splitserve.common.chat import CONTENT_FORMATS
from splitserve.common.vocab import Connector, Role, TransferStatus


class WireError(ValueError):
    """A worker's answer does not have the shape its route promises."""


def _obj(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise WireError(f"{what} must be a JSON object, got {type(raw).__name__}")
    return raw


def _num(raw: dict[str, Any], key: str, what: str, default: float | None = 0.0
         ) -> float | None:
    """A finite number (None stays None)."""
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise WireError(f"{what}.{key} must be a number, got {value!r}")


def _count(raw: dict[str, Any], key: str, what: str, default: int | None = 0) -> int | None:
    """A non-negative integer (None stays None)."""
    value = raw.get(key, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise WireError(f"{what}.{key} must be a non-negative integer, got {value!r}")


def _str(raw: dict[str, Any], key: str, what: str) -> str | None:
    value = raw.get(key)
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{what}.{key} must be a string, got {value!r}")


def _bool(raw: dict[str, Any], key: str, what: str, default: bool = False) -> bool:
    value = raw.get(key, default)
    if isinstance(value, bool):
        return value
    raise WireError(f"{what}.{key} must be true or false, got {value!r}")


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
    An answer without `connector` is a splitserve worker's (the key came later).
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
    # the worker reports its prefix cache (`kvindex.messages`' routes) in blocks of block_size
    # tokens; whether its view is exact right now is the snapshot's `exact`
    kv_events: bool = False
    block_size: int | None = None
    # how the worker's vLLM renders a chat (`common.chat`): the content format it gives the
    # template ("string" | "openai") and the digest of its template and default kwargs
    chat_format: str | None = None
    chat_template_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.kv_port is not None and not 0 < self.kv_port < 65536:
            raise WireError(f"info.kv_port must be a port number, got {self.kv_port}")
        if self.progress_delay_us is not None and self.progress_delay_us < 0:
            raise WireError("info.progress_delay_us must not be negative")
        if self.block_size is not None and self.block_size < 1:
            raise WireError("info.block_size must be positive")
        if self.kv_events and self.block_size is None:
            raise WireError("info.kv_events needs info.block_size")
        if self.chat_format not in (None, *CONTENT_FORMATS):
            raise WireError(f"info.chat_format must be one of {CONTENT_FORMATS}, "
                            f"got {self.chat_format!r}")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "info")
        fp = raw.get("model_fingerprint")
        if fp is not None and not isinstance(fp, dict):
            raise WireError("info.model_fingerprint must be an object")
        return cls(connector=_enum(Connector, raw.get("connector", Connector.SPLITSERVE),
                                   "info.connector"),
                   role=_enum(Role, raw.get("role"), "info.role"),
                   transport=_str(raw, "transport", "info"),
                   kv_host=_str(raw, "kv_host", "info"),
                   kv_port=_count(raw, "kv_port", "info", None),
                   kv_tls=_bool(raw, "kv_tls", "info"),
                   engine_id=_str(raw, "engine_id", "info"),
                   model_fingerprint=fp, vllm_version=_str(raw, "vllm_version", "info"),
                   progress_delay_us=_count(raw, "progress_delay_us", "info", None),
                   kv_events=_bool(raw, "kv_events", "info"),
                   block_size=_count(raw, "block_size", "info", None),
                   chat_format=_str(raw, "chat_format", "info"),
                   chat_template_sha256=_str(raw, "chat_template_sha256", "info"))

    def to_json(self) -> dict[str, Any]:
        """Every field set, plus `kv_host` and `kv_port` always (None: no endpoint);
        `kv_events` only when true."""
        out = {k: v for k, v in asdict(self).items()
               if (v is not None or k in ("kv_host", "kv_port"))
               and not (k == "kv_events" and not v)}
        out.update(connector=self.connector.value, role=self.role.value)
        return out


@dataclass(frozen=True)
class WorkerLoad:
    """`GET /splitserve/load` (or the same gauges parsed from a plain worker's `/metrics`):
    vLLM's KV cache usage (0..1) and its running and waiting requests. A gauge the engine has
    not published yet is None (and absent from `to_json`)."""

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
            what = f"state.transfers.{f.name}"
            table = _obj(raw.get(f.name, {}), what)
            read = _num if f.name == "seconds_total" else _count
            out[f.name] = {k: read(table, k, what, None) for k in table}
            if any(v is None for v in out[f.name].values()):
                raise WireError(f"{what} holds a null")
        return cls(**out)

    def to_json(self) -> dict[str, dict[str, Any]]:
        return asdict(self)

    def plus(self, other: TransferCounters) -> TransferCounters:
        """Both counters summed, key by key."""
        def add(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}

        return TransferCounters(*(add(getattr(self, f.name), getattr(other, f.name))
                                  for f in fields(self)))


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

    COUNTS: ClassVar[tuple[str, ...]] = (
        "staged_bytes", "staging_capacity_bytes", "staging_free_bytes", "open_leases",
        "claimed_transfers", "pending_loads", "held_sends")

    def __post_init__(self) -> None:
        for key in self.COUNTS:
            if getattr(self, key) < 0:
                raise WireError(f"state.{key} must not be negative")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "state")
        counts: dict[str, int] = {}
        for key in cls.COUNTS:
            value = _count(raw, key, "state")
            if value is None:
                raise WireError(f"state.{key} must be a non-negative integer, got None")
            counts[key] = value
        return cls(info=WorkerInfo.from_json(raw), **counts,
                   transfers=TransferCounters.from_json(raw.get("transfers", {})))

    @classmethod
    def of_ranks(cls, states: list[Self]) -> Self:
        """A worker of several tensor-parallel ranks as one: rank 0's identity (the first
        state), every count and counter summed over the ranks (a transfer between TP workers
        counts once for each rank's piece)."""
        if not states:
            raise ValueError("a worker has at least one rank")
        transfers = states[0].transfers
        for st in states[1:]:
            transfers = transfers.plus(st.transfers)
        return cls(info=states[0].info, transfers=transfers,
                   **{k: sum(getattr(st, k) for st in states) for k in cls.COUNTS})

    def to_json(self) -> dict[str, Any]:
        """The worker's info, each count, and `transfers` (the counters), in one object."""
        return {**self.info.to_json(), **{k: getattr(self, k) for k in self.COUNTS},
                "transfers": self.transfers.to_json()}


@dataclass(frozen=True)
class SideRecord:
    """One worker's record of one transfer (`side` "send" on P, "recv" on D). Times are epoch
    seconds on that worker's clock; derived: `duration_s` (BEGIN to verified END), `tail_s`
    (what the overlap with P's prefill leaves exposed), `gbps` (bytes / `wire_s`).
    `final`: the status can no longer change (the router stops asking)."""

    SIDES: ClassVar[tuple[str, ...]] = ("send", "recv")

    transfer_id: str
    side: str
    status: TransferStatus
    tokens: int = 0  # prompt tokens moved
    bytes: int = 0  # KV bytes moved
    skipped_tokens: int = 0  # the prompt's prefix not moved (D's prefix cache was to hold it)
    cause: str | None = None
    started_s: float | None = None
    first_byte_s: float | None = None
    complete_s: float | None = None
    load_s: float | None = None
    loaded_tokens: int | None = None
    load_mode: str | None = None
    scheduled_s: float | None = None
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
        if self.side not in self.SIDES:
            raise WireError(f"record.side must be send or recv, got {self.side!r}")
        if not self.transfer_id:
            raise WireError("record.transfer_id must not be empty")

    @property
    def final(self) -> bool:
        return self.status.terminal

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "record")
        tid, side = raw.get("transfer_id"), raw.get("side")
        if not isinstance(tid, str):
            raise WireError(f"record.transfer_id must be a string, got {tid!r}")
        if not isinstance(side, str):
            raise WireError(f"record.side must be a string, got {side!r}")
        kw: dict[str, Any] = {}
        for name, hint in _record_fields().items():
            if name in raw and raw[name] is not None:
                read = _str if hint == "str" else _count if hint == "int" else _num
                kw[name] = read(raw, name, "record")
        return cls(transfer_id=tid, side=side,
                   status=_enum(TransferStatus, raw.get("status"), "record.status"), **kw)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}


@cache
def _record_fields() -> dict[str, str]:
    """`SideRecord`'s optional fields by the JSON type they take: "str", "int" or "float"."""
    hints = typing.get_type_hints(SideRecord)
    out: dict[str, str] = {}
    for f in fields(SideRecord):
        if f.name in ("transfer_id", "side", "status"):
            continue
        kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        out[f.name] = "str" if str in kinds else "int" if int in kinds else "float"
    return out


@dataclass(frozen=True)
class TransferRecord:
    """`GET /splitserve/transfers/{id}`: what this worker recorded of one transfer, per side."""

    transfer_id: str
    recv: SideRecord | None = None
    send: SideRecord | None = None

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "transfer")
        tid = raw.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            raise WireError(f"transfer.transfer_id must be a non-empty string, got {tid!r}")
        sides = {s: SideRecord.from_json(raw[s]) for s in SideRecord.SIDES
                 if raw.get(s) is not None}
        for side, rec in sides.items():
            if rec.side != side or rec.transfer_id != tid:
                raise WireError(f"transfer.{side} is the {rec.side} record of {rec.transfer_id}")
        return cls(transfer_id=tid, **sides)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"transfer_id": self.transfer_id}
        for side in ("recv", "send"):
            rec = getattr(self, side)
            if rec is not None:
                out[side] = rec.to_json()
        return out
