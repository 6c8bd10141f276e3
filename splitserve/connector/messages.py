"""The KV channel's messages: one frozen dataclass per frame body.

`to_wire()` gives the JSON body (fields whose value is None are left out); `from_wire(body)`
checks that every field without a default is present and that every field has its declared
JSON type, and raises `ProtocolError` otherwise, so a malformed frame ends its connection
instead of being read with made-up defaults. `send`/`encode` frame a message with its `OP`;
`recv` reads the next frame as the message its op names.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar, Union

from splitserve.connector.framing import Op, ProtocolError, encode_frame, recv_frame
from splitserve.connector.tls import Conn

M = TypeVar("M", bound="Message")


@cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type, required) of each field of a message class."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls))


def _matches(value: Any, hint: Any) -> bool:
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


@dataclass(frozen=True)
class Message:
    OP: ClassVar[Op]

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_wire(cls: type[M], body: Any) -> M:
        if not isinstance(body, dict):
            raise ProtocolError(f"{cls.OP.name} body is not an object")
        values: dict[str, Any] = {}
        message_class: type = cls
        for name, hint, required in _fields(message_class):
            if name not in body:
                if required:
                    raise ProtocolError(f"{cls.OP.name} frame lacks {name!r}")
                continue
            value = body[name]
            if not _matches(value, hint):
                raise ProtocolError(f"{cls.OP.name} frame's {name!r} is not {hint}: {value!r}")
            values[name] = value
        return cls(**values)


# -- handshake (see protocol.py) ---------------------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    OP = Op.HELLO
    nonce: str
    version: int


@dataclass(frozen=True)
class Auth(Message):
    OP = Op.AUTH
    client_nonce: str
    mac: str
    purpose: str  # "push" or "control"
    fingerprint: dict[str, Any] = field(default_factory=dict)  # a `Fingerprint`, for "push"


@dataclass(frozen=True)
class Welcome(Message):
    OP = Op.WELCOME
    mac: str
    staging: dict[str, Any] = field(default_factory=dict)  # `StagingInfo.to_wire()`


@dataclass(frozen=True)
class Refuse(Message):
    OP = Op.REFUSE
    reason: str


@dataclass(frozen=True)
class StagingInfo:
    """What D's listener tells a pusher about its staging area (in WELCOME): for shm, the
    segment to map; empty on a worker without staging."""

    shm_path: str | None = None
    size: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> StagingInfo:
        path, size = body.get("shm_path"), body.get("size")
        if not (path is None or isinstance(path, str)) or not (size is None or _matches(size, int)):
            raise ProtocolError("malformed staging info")
        return cls(path, size)


# -- a push connection -------------------------------------------------------------------------
@dataclass(frozen=True)
class Begin(Message):
    """A transfer of the prompt tokens [skip, tokens): `tokens` is the prompt's length, `skip`
    the prefix P does not send because D's prefix cache is expected to hold it (0: the whole
    prompt). D stages exactly `tokens - skip` tokens; a D that predates `skip` reads the
    frame without it and fails the transfer as short (never a misread)."""

    OP = Op.BEGIN
    transfer_id: str
    tokens: int
    skip: int = 0


@dataclass(frozen=True)
class BeginOk(Message):
    OP = Op.BEGIN_OK
    transfer_id: str
    offset: int  # the transfer's region in D's staging segment


@dataclass(frozen=True)
class BeginRefused(Message):
    OP = Op.BEGIN_REFUSED
    transfer_id: str
    cause: str  # e.g. "staging_full", "not_a_decode_worker"


@dataclass(frozen=True)
class Layer(Message):
    """One layer's chunk [start, end): `nbytes` of staging format, xxh3 `checksum`. `inline`:
    the payload follows the frame (tcp); otherwise it is already in D's segment (shm), written
    at wall time `written_s`."""

    OP = Op.LAYER
    transfer_id: str
    layer: int
    start: int
    end: int
    nbytes: int
    checksum: str
    inline: bool = True
    written_s: float | None = None


@dataclass(frozen=True)
class End(Message):
    """Every layer of every token was sent. P's `last_layer_s` (wall time its last layer was
    handed to the channel), `end_lag_s` (seconds from then to this END, on P's clock) and
    `wire_s` (seconds its bytes moved), for D's record."""

    OP = Op.END
    transfer_id: str
    last_layer_s: float | None = None
    end_lag_s: float | None = None
    wire_s: float | None = None


@dataclass(frozen=True)
class Ack(Message):
    OP = Op.ACK
    transfer_id: str
    ok: bool
    cause: str | None = None  # why not ok


@dataclass(frozen=True)
class Abort(Message):
    OP = Op.ABORT
    transfer_id: str


# -- a control connection ----------------------------------------------------------------------
@dataclass(frozen=True)
class Query(Message):
    """"state" (the connector's state), "transfer" (one transfer's record) or "discard" (drop a
    staged transfer), the latter two naming `transfer_id`."""

    OP = Op.QUERY
    what: str = "state"
    transfer_id: str | None = None


@dataclass(frozen=True)
class Answer(Message):
    """A control answer: a JSON document (the state, a transfer's record, or {"error": ...})."""

    OP = Op.ANSWER
    body: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return self.body

    @classmethod
    def from_wire(cls, body: Any) -> Answer:
        if not isinstance(body, dict):
            raise ProtocolError("ANSWER body is not an object")
        return cls(body)


MESSAGES: Mapping[Op, type[Message]] = MappingProxyType({cls.OP: cls for cls in (
    Hello, Auth, Welcome, Refuse, Begin, BeginOk, BeginRefused, Layer, End, Ack, Abort, Query,
    Answer)})


def encode(msg: Message) -> bytes:
    return encode_frame(msg.OP, msg.to_wire())


def send(sock: Conn, msg: Message) -> None:
    sock.sendall(encode(msg))


def decode(op: Op, body: Any) -> Message:
    return MESSAGES[op].from_wire(body)


def recv(sock: Conn) -> Message:
    """The next frame, as its message. Raises ProtocolError on a malformed one."""
    op, body = recv_frame(sock)
    return decode(op, body)
