"""The KV channel's wire protocol: framing, messages, and the authenticated handshake.

Every frame is `HEADER` (magic, op, body length) followed by a JSON body. A `LAYER` frame's body
names `nbytes`; over tcp that many payload bytes follow the frame, over shm the payload is already
in D's staging segment. One connection carries one peer's transfers, in order.

Handshake (server = the D-side listener, client = a P-side pusher or a control client):
  server -> HELLO  {nonce}
  client -> AUTH   {client_nonce, mac = HMAC(token, "client" | nonce | client_nonce), purpose,
                    fingerprint}
  server -> WELCOME {mac = HMAC(token, "server" | client_nonce | nonce), staging}   or REFUSE
No KV moves before both macs verify and, for `purpose == "push"`, the model fingerprints match.

With TLS configured (connector/tls.py), every connection to the listener is TLS first; the
frames and the handshake above run inside it unchanged.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import secrets
import socket
import ssl
import struct
from dataclasses import asdict, dataclass
from typing import Any

from splitserve.connector.tls import Conn, TlsStream

MAGIC = b"SS"
PROTOCOL_VERSION = 1
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


@dataclass(frozen=True)
class Fingerprint:
    """What must match between P and D before KV moves."""

    config_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vllm_version: str

    def mismatch(self, other: Fingerprint) -> str | None:
        for key, mine in asdict(self).items():
            theirs = getattr(other, key)
            if mine != theirs:
                return f"{key} differs: decode has {mine!r}, prefill has {theirs!r}"
        return None


def config_hash(hf_config_dict: dict[str, Any]) -> str:
    drop = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures"}
    canonical = {k: v for k, v in hf_config_dict.items() if k not in drop}
    blob = json.dumps(canonical, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def encode_frame(op: Op, body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body or {}, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, int(op), len(data)) + data


def send_frame(sock: Conn, op: Op, body: dict[str, Any] | None = None) -> None:
    sock.sendall(encode_frame(op, body))


def send_parts(sock: Conn, parts: list[bytes | memoryview]) -> None:
    """Send `parts` back to back. On a plain socket one gathering `sendmsg` per pass: a frame
    and its payload leave in one system call, so D wakes once per frame rather than per part."""
    if not isinstance(sock, socket.socket):  # TLS records: no gathering send
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


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


def _mac(token: str, side: bytes, a: str, b: str) -> str:
    msg = b"|".join((side, a.encode(), b.encode(), str(PROTOCOL_VERSION).encode()))
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def server_handshake(sock: Conn, token: str, mine: Fingerprint,
                     staging: dict[str, Any]) -> str:
    """Authenticate a client; return its purpose ("push" or "control"). Raises ProtocolError."""
    nonce = secrets.token_hex(16)
    send_frame(sock, Op.HELLO, {"nonce": nonce, "version": PROTOCOL_VERSION})
    op, body = recv_frame(sock)
    if op != Op.AUTH:
        send_frame(sock, Op.REFUSE, {"reason": "authenticate first"})
        raise ProtocolError("expected AUTH")
    client_nonce = str(body.get("client_nonce", ""))
    expected = _mac(token, b"client", nonce, client_nonce)
    if len(client_nonce) < 16 or not hmac.compare_digest(expected, str(body.get("mac", ""))):
        send_frame(sock, Op.REFUSE, {"reason": "authentication failed"})
        raise ProtocolError("authentication failed")
    purpose = body.get("purpose")
    if purpose == "push":
        try:
            theirs = Fingerprint(**body.get("fingerprint", {}))
        except TypeError:
            send_frame(sock, Op.REFUSE, {"reason": "malformed fingerprint"})
            raise ProtocolError("malformed fingerprint") from None
        problem = mine.mismatch(theirs)
        if problem:
            send_frame(sock, Op.REFUSE, {"reason": f"model mismatch: {problem}"})
            raise ProtocolError(f"model mismatch: {problem}")
    elif purpose != "control":
        send_frame(sock, Op.REFUSE, {"reason": "unknown purpose"})
        raise ProtocolError("unknown purpose")
    send_frame(sock, Op.WELCOME, {"mac": _mac(token, b"server", client_nonce, nonce),
                                  "staging": staging})
    return str(purpose)


def client_handshake(sock: Conn, token: str, purpose: str,
                     fingerprint: Fingerprint | None) -> dict[str, Any]:
    """Prove the token to the server and check its proof; return the server's staging info."""
    op, body = recv_frame(sock)
    if op != Op.HELLO or body.get("version") != PROTOCOL_VERSION:
        raise ProtocolError("peer is not a compatible splitserve KV listener")
    nonce = str(body["nonce"])
    client_nonce = secrets.token_hex(16)
    send_frame(sock, Op.AUTH, {
        "client_nonce": client_nonce, "mac": _mac(token, b"client", nonce, client_nonce),
        "purpose": purpose, "fingerprint": asdict(fingerprint) if fingerprint else {},
    })
    op, body = recv_frame(sock)
    if op == Op.REFUSE:
        raise ProtocolError(f"refused by peer: {body.get('reason')}")
    if op != Op.WELCOME or not hmac.compare_digest(
        str(body.get("mac", "")), _mac(token, b"server", client_nonce, nonce)
    ):
        raise ProtocolError("peer failed to prove the deployment token")
    return dict(body.get("staging", {}))


def connect(host: str, port: int, token: str, purpose: str, fingerprint: Fingerprint | None,
            timeout_s: float, tls: ssl.SSLContext | None = None
            ) -> tuple[Conn, dict[str, Any]]:
    """Connect, then (with `tls`: verify the listener's certificate for `host` and) authenticate.
    Raises OSError (ssl.SSLError when TLS fails) or ProtocolError."""
    raw = socket.create_connection((host, port), timeout=timeout_s)
    sock: Conn = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = TlsStream(raw, tls, server_side=False, server_hostname=host)
        info = client_handshake(sock, token, purpose, fingerprint)
    except BaseException:
        raw.close()
        raise
    sock.settimeout(None)
    return sock, info


def query(host: str, port: int, token: str, body: dict[str, Any],
          timeout_s: float = 2.0, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """One control round trip to a listener (state, or one transfer's record)."""
    sock, _ = connect(host, port, token, "control", None, timeout_s, tls)
    with sock:
        sock.settimeout(timeout_s)
        send_frame(sock, Op.QUERY, body)
        op, answer = recv_frame(sock)
        if op != Op.ANSWER:
            raise ProtocolError("expected ANSWER")
        return answer
