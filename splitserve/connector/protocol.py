"""The KV channel's authenticated handshake, the model fingerprint, and connecting to a
listener. Frames are `framing.py`'s; their bodies are `messages.py`'s typed messages.

Handshake (server = the D-side listener, client = a P-side pusher or a control client):
  server -> HELLO  {nonce, version}
  client -> AUTH   {client_nonce, mac = HMAC(token, "client" | nonce | client_nonce), purpose,
                    fingerprint}
  server -> WELCOME {mac = HMAC(token, "server" | client_nonce | nonce), staging}   or REFUSE
No KV moves before both macs verify and, for `purpose == "push"`, the model fingerprints match.

With TLS configured (connector/tls.py), every connection to the listener is TLS first; the
frames and the handshake above run inside it unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import ssl
from dataclasses import asdict, dataclass
from typing import Any

from splitserve.connector.framing import Op, ProtocolError, recv_frame
from splitserve.connector.messages import (
    Answer,
    Auth,
    Hello,
    Query,
    Refuse,
    StagingInfo,
    Welcome,
    recv,
    send,
)
from splitserve.connector.ranks import check_tp
from splitserve.connector.tls import Conn, TlsStream

PROTOCOL_VERSION = 1


class PeerRefused(ProtocolError):
    """The listener answered the handshake with REFUSE (wrong token, model mismatch, unknown
    purpose); `reason` is its stated reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"refused by peer: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Fingerprint:
    """What must match between P and D before KV moves: the whole model (`num_kv_heads` is
    the model's, not a rank's), and tensor-parallel sizes that can share its heads. `tp_size`
    and `tp_rank` are the side's own and may differ."""

    config_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vllm_version: str
    tp_size: int = 1
    tp_rank: int = 0
    latent: bool = False

    def mismatch(self, other: Fingerprint) -> str | None:
        for key, mine in asdict(self).items():
            theirs = getattr(other, key)
            if key not in ("tp_size", "tp_rank") and mine != theirs:
                return f"{key} differs: decode has {mine!r}, prefill has {theirs!r}"
        try:
            check_tp(self.num_kv_heads, other.tp_size, self.latent)
            check_tp(self.num_kv_heads, self.tp_size, self.latent)
        except ValueError as exc:
            return (f"decode tp {self.tp_size} and prefill tp {other.tp_size} cannot share "
                    f"{self.num_kv_heads} KV heads ({exc})")
        return None


def config_hash(hf_config_dict: dict[str, Any]) -> str:
    drop = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures"}
    canonical = {k: v for k, v in hf_config_dict.items() if k not in drop}
    blob = json.dumps(canonical, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _mac(token: str, side: bytes, a: str, b: str) -> str:
    msg = b"|".join((side, a.encode(), b.encode(), str(PROTOCOL_VERSION).encode()))
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def _refuse(sock: Conn, reason: str) -> ProtocolError:
    send(sock, Refuse(reason))
    return ProtocolError(reason)


def server_handshake(sock: Conn, token: str, mine: Fingerprint, staging: StagingInfo) -> str:
    """Authenticate a client; return its purpose ("push" or "control"). Raises ProtocolError."""
    nonce = secrets.token_hex(16)
    send(sock, Hello(nonce, PROTOCOL_VERSION))
    op, body = recv_frame(sock)
    if op != Op.AUTH:
        send(sock, Refuse("authenticate first"))
        raise ProtocolError("expected AUTH")
    try:
        auth = Auth.from_wire(body)
    except ProtocolError:
        raise _refuse(sock, "authentication failed") from None
    expected = _mac(token, b"client", nonce, auth.client_nonce)
    if len(auth.client_nonce) < 16 or not hmac.compare_digest(expected, auth.mac):
        raise _refuse(sock, "authentication failed")
    if auth.purpose == "push":
        try:
            theirs = Fingerprint(**auth.fingerprint)
        except TypeError:
            raise _refuse(sock, "malformed fingerprint") from None
        problem = mine.mismatch(theirs)
        if problem:
            raise _refuse(sock, f"model mismatch: {problem}")
    elif auth.purpose != "control":
        raise _refuse(sock, "unknown purpose")
    send(sock, Welcome(_mac(token, b"server", auth.client_nonce, nonce), staging.to_wire()))
    return auth.purpose


def client_handshake(sock: Conn, token: str, purpose: str,
                     fingerprint: Fingerprint | None) -> StagingInfo:
    """Prove the token to the server and check its proof; return the server's staging info.
    Raises `PeerRefused` when the server refuses, `ProtocolError` on anything else amiss."""
    op, body = recv_frame(sock)
    try:
        hello = Hello.from_wire(body) if op == Op.HELLO else None
    except ProtocolError:
        hello = None
    if hello is None or hello.version != PROTOCOL_VERSION:
        raise ProtocolError("peer is not a compatible splitserve KV listener")
    client_nonce = secrets.token_hex(16)
    send(sock, Auth(client_nonce, _mac(token, b"client", hello.nonce, client_nonce), purpose,
                    asdict(fingerprint) if fingerprint else {}))
    reply = recv(sock)
    if isinstance(reply, Refuse):
        raise PeerRefused(reply.reason)
    if not isinstance(reply, Welcome) or not hmac.compare_digest(
        reply.mac, _mac(token, b"server", client_nonce, hello.nonce)
    ):
        raise ProtocolError("peer failed to prove the deployment token")
    return StagingInfo.from_wire(reply.staging)


# A peer whose host died, or that a partition cut off, sends nothing, not even a FIN: without
# these a thread blocked reading (D's listener) or writing (P's sender) on it would wait for
# ever, holding D's staged region or P's engine thread. Idle, the kernel probes after
# KEEPALIVE_IDLE_S and gives up after KEEPALIVE_PROBES unanswered probes; bytes sent and not
# acknowledged within UNACKED_TIMEOUT_S end the connection too. Either way the blocked call
# raises OSError: a lost connection, failed as every other.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
UNACKED_TIMEOUT_S = 30


def watch_peer(raw: socket.socket) -> None:
    """Bound how long a connection to a vanished peer stays open (see `KEEPALIVE_IDLE_S`)."""
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                        ("TCP_USER_TIMEOUT", UNACKED_TIMEOUT_S * 1000)):
        if hasattr(socket, name):  # Linux has them all
            raw.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def connect(host: str, port: int, token: str, purpose: str, fingerprint: Fingerprint | None,
            timeout_s: float, tls: ssl.SSLContext | None = None
            ) -> tuple[Conn, StagingInfo]:
    """Connect, then (with `tls`: verify the listener's certificate for `host` and) authenticate.
    Raises OSError (ssl.SSLError when TLS fails) or ProtocolError."""
    raw = socket.create_connection((host, port), timeout=timeout_s)
    sock: Conn = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        watch_peer(raw)
        if tls is not None:
            sock = TlsStream(raw, tls, server_side=False, server_hostname=host)
        info = client_handshake(sock, token, purpose, fingerprint)
    except BaseException:
        raw.close()
        raise
    sock.settimeout(None)
    return sock, info


def query(host: str, port: int, token: str, question: Query,
          timeout_s: float = 2.0, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """One control round trip to a listener (state, or one transfer's record)."""
    sock, _ = connect(host, port, token, "control", None, timeout_s, tls)
    with sock:
        sock.settimeout(timeout_s)
        send(sock, question)
        answer = recv(sock)
        if not isinstance(answer, Answer):
            raise ProtocolError("expected ANSWER")
        return answer.body
