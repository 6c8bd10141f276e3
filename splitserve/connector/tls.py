"""Optional TLS for the KV channel (every connection to a listener's port: pushes and control).

Contexts come from the connector's config (file paths only): the listener presents
`tls_cert`/`tls_key`; a client verifies the listener's certificate and host name against
`tls_ca` (the system's CAs when none is given). With `tls_ca`, TLS is mutual: the listener also
requires a client certificate signed by that CA, and clients present `tls_cert`/`tls_key`.
TLS 1.2 at least. The HMAC token handshake and the per-layer checksums run inside TLS unchanged.

`TlsStream` wraps a connected blocking socket. OpenSSL forbids concurrent SSL_read and
SSL_write on one connection, but a push channel reads ACKs in one thread while its sender
writes in another. So the TLS state works on memory buffers and is only touched under `_state`
(never while blocked on the network); the socket itself stays full-duplex. Invariant: one reader
thread and one writer thread at a time; ciphertext leaves in the order OpenSSL produced it
(everything sent is drained from `_out` under `_send`).
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import TypeAlias, cast

from splitserve.config import ConnectorConfig

READ_SIZE = 256 * 1024
WRITE_CHUNK = 256 * 1024


def _load(ctx: ssl.SSLContext, cert: str, key: str, ca: str | None) -> None:
    """Load the files, or raise ValueError naming them (OpenSSL's own message is terse)."""
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"kv TLS: cannot load certificate {cert} with key {key}: {exc}"
                         ) from exc
    try:
        if ca:
            ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"kv TLS: cannot load CA bundle {ca}: {exc}") from exc


def server_context(cfg: ConnectorConfig) -> ssl.SSLContext | None:
    """The listener's context, or None when TLS is not configured."""
    if not cfg.tls_enabled:
        return None
    assert cfg.tls_cert is not None and cfg.tls_key is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    if cfg.tls_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cfg: ConnectorConfig) -> ssl.SSLContext | None:
    """A pusher's or control client's context, or None when TLS is not configured."""
    if not cfg.tls_enabled:
        return None
    assert cfg.tls_cert is not None and cfg.tls_key is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not cfg.tls_ca:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    _load(ctx, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)  # the cert is presented if asked for
    return ctx


class TlsStream:
    """A TLS connection over a connected socket, with the socket calls the channel uses."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side,
                                 server_hostname=None if server_side else server_hostname)
        self._state = threading.Lock()  # guards _tls, _in, _out
        self._send = threading.Lock()  # held while ciphertext is drained and sent
        self._handshake()

    def _handshake(self) -> None:
        """Complete the TLS handshake under the socket's current timeout; raises ssl.SSLError
        (refused: bad certificate, wrong host, not TLS) or OSError."""
        while True:
            try:
                with self._state:
                    self._tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                if not self._feed():
                    raise ssl.SSLEOFError("peer closed the connection during the TLS handshake"
                                          ) from None

    def _flush(self) -> None:
        with self._send:
            with self._state:
                data = self._out.read()
            if data:
                self._sock.sendall(data)

    def _feed(self) -> bool:
        """Move ciphertext from the socket into the TLS state; False at end of stream."""
        data = self._sock.recv(READ_SIZE)
        with self._state:
            if data:
                self._in.write(data)
            else:
                self._in.write_eof()
        return bool(data)

    # -- the socket calls the KV channel makes -----------------------------------------------
    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._send:
            for i in range(0, len(view), WRITE_CHUNK):
                with self._state:
                    self._tls.write(view[i:i + WRITE_CHUNK])
                    out = self._out.read()
                self._sock.sendall(out)

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int:
        """Plaintext into `buffer`; 0 once the peer has closed (cleanly or not)."""
        n = nbytes or len(buffer)
        ended = False
        while True:
            try:
                with self._state:
                    return cast(int, self._tls.read(n, buffer))  # with a buffer: a count
            except ssl.SSLWantReadError:
                if ended:
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0
            with self._state:
                answer = self._out.pending  # e.g. a TLS 1.3 key update answered by the read
            if answer:
                self._flush()
            ended = not self._feed()  # at the end, read() reports it (or returns 0 above)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._sock.setsockopt(level, option, value)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def version(self) -> str | None:
        return self._tls.version()

    def __enter__(self) -> TlsStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Conn: TypeAlias = socket.socket | TlsStream
