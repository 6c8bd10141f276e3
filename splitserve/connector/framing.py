"""Framing on the KV channel: every frame is `HEADER` (magic, op, body length) followed by a
JSON body (a message of `messages.py`). A `LAYER` frame's body names `nbytes`; over tcp that
many payload bytes follow the frame, over shm the payload is already in D's staging segment.
One connection carries one peer's frames, in order."""

from __future__ import annotations

import enum
import json
import os
import socket
import struct
from typing import Any

from splitserve.connector.tls import Conn

MAGIC = b"SS"
HEADER = struct.Struct("!2sBI")
MAX_BODY = 1 << 20


class Op(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    REFUSE = 4
    BEGIN = 10  # P -> D: reserve staging for a transfer
    BEGIN_OK = 11  # D -> P: reserved (with the region's offset for shm)
    BEGIN_REFUSED = 12  # D -> P: cannot stage (full, duplicate id, bad shape)
    LAYER = 13  # P -> D: one layer's KV for a token range, with its checksum
    END = 14  # P -> D: every layer of every token has been sent
    ACK = 15  # D -> P: transfer received and verified (or failed, with a cause)
    ABORT = 16  # P -> D: drop this transfer
    QUERY = 20  # control client -> D: state or one transfer's record
    ANSWER = 21


class ProtocolError(ConnectionError):
    """The peer broke the protocol, failed authentication, or went away mid-frame."""


def encode_frame(op: Op, body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body or {}, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, int(op), len(data)) + data


def send_frame(sock: Conn, op: Op, body: dict[str, Any] | None = None) -> None:
    sock.sendall(encode_frame(op, body))


# The most buffers one `sendmsg` takes (Linux: 1024; more fail with EMSGSIZE).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def send_parts(sock: Conn, parts: list[bytes | memoryview]) -> None:
    """Send `parts` back to back. On a plain socket one gathering `sendmsg` per pass of up to
    `IOV_MAX` parts: a frame and its payload leave in one system call, so D wakes once per
    frame rather than per part."""
    if not isinstance(sock, socket.socket):  # TLS records: no gathering send
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    first = 0  # views[first:] are still to send
    while first < len(views):
        sent = sock.sendmsg(views[first:first + IOV_MAX])
        while first < len(views) and sent >= len(views[first]):
            sent -= len(views[first])
            first += 1
        if sent:
            views[first] = views[first][sent:]


def recv_exact_into(sock: Conn, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("peer closed the connection mid-frame")
        got += k


def recv_frame(sock: Conn) -> tuple[Op, dict[str, Any]]:
    head = bytearray(HEADER.size)
    recv_exact_into(sock, memoryview(head))
    magic, op, length = HEADER.unpack(head)
    if magic != MAGIC or length > MAX_BODY:
        raise ProtocolError("not a splitserve KV frame")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body))
    try:
        return Op(op), json.loads(body) if length else {}
    except (ValueError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc
