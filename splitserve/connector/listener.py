"""D's side of the KV channel: accept authenticated pushers and control clients.

One thread per connection. A push connection's transfers are written into the StagingArea;
every LAYER is verified against its checksum as it lands, END is answered with an ACK (ok, or
the failure's cause). A connection that drops fails every transfer it had not ended.
Control connections answer QUERY with the connector's state or one transfer's record.
With a TLS context, the port speaks only TLS: a connection that does not complete the TLS
handshake (plain client, untrusted certificate) is closed before the token handshake begins.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

from splitserve.common.vocab import TransferStatus
from splitserve.connector.faults import Faults
from splitserve.connector.framing import ProtocolError, recv_exact_into
from splitserve.connector.layout.staging_format import region_offset
from splitserve.connector.messages import (
    Abort,
    Ack,
    Answer,
    Begin,
    BeginOk,
    BeginRefused,
    End,
    Layer,
    Query,
    StagingInfo,
    recv,
    send,
)
from splitserve.connector.protocol import Fingerprint, server_handshake, watch_peer
from splitserve.connector.staging import StagedTransfer, StagingArea, StagingRefused
from splitserve.connector.tls import Conn, TlsStream

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 0.5


class KVListener:
    def __init__(self, host: str, port: int, token: str, fingerprint: Fingerprint,
                 staging: StagingArea | None, answer: Callable[[Query], dict[str, Any]],
                 tls: ssl.SSLContext | None = None, faults: Faults | None = None) -> None:
        self._token = token
        self._faults = faults or Faults(enabled=False)
        self._tls = tls
        self._fingerprint = fingerprint
        self._staging = staging
        self._answer = answer
        self._stop = threading.Event()
        self._conns: dict[socket.socket, threading.Thread] = {}  # accepted, not yet ended
        self._conns_lock = threading.Lock()
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.5)
        self.port = int(self._server.getsockname()[1])
        threading.Thread(target=self._accept_loop, daemon=True, name="splitserve-kv-accept").start()
        if staging is not None:
            threading.Thread(target=self._reap_loop, daemon=True, name="splitserve-reaper").start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop accepting and end every connection (P sees its D gone); returns once their
        threads are done with the staging area (or after `timeout_s`), so it may be closed."""
        self._stop.set()
        self._server.close()
        with self._conns_lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout_s
        for thread in conns.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    def _reap_loop(self) -> None:
        assert self._staging is not None
        while not self._stop.wait(REAP_INTERVAL_S):
            self._staging.reap()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():  # closed
                    return
                # out of descriptors, or a connection that died in the queue: keep listening
                log.warning("KV listener: accept failed (%r)", exc)
                time.sleep(0.1)
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name="splitserve-kv-conn")
            with self._conns_lock:
                if self._stop.is_set():  # closed meanwhile: this connection is not served
                    conn.close()
                    return
                self._conns[conn] = thread
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: refuse this one, keep listening
                log.warning("KV listener: cannot serve a connection (%r)", exc)
                with self._conns_lock:
                    self._conns.pop(conn, None)
                conn.close()
                time.sleep(0.1)

    def _staging_info(self) -> StagingInfo:
        if self._staging is None:
            return StagingInfo()
        return StagingInfo(self._staging.segment.path, self._staging.segment.size)

    def _serve(self, raw: socket.socket) -> None:
        open_transfers: dict[str, StagedTransfer] = {}
        with raw:
            try:
                raw.settimeout(10.0)  # the handshakes must not hold a thread forever
                watch_peer(raw)  # nor, after them, a peer that vanished without a word
                conn: Conn = raw
                if self._tls is not None:
                    conn = TlsStream(raw, self._tls, server_side=True)
                purpose = server_handshake(conn, self._token, self._fingerprint,
                                           self._staging_info())
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if purpose == "control":
                    self._serve_control(conn)
                else:
                    same_host = raw.getpeername()[0] == raw.getsockname()[0]
                    self._serve_push(conn, open_transfers, same_host)
            except (OSError, ProtocolError):
                pass
            finally:
                with self._conns_lock:
                    self._conns.pop(raw, None)
                if self._staging is not None:
                    for st in open_transfers.values():
                        self._staging.fail(st, "peer_gone")
                        self._staging.writer_done(st)

    def _serve_control(self, conn: Conn) -> None:
        while True:
            msg = recv(conn)
            if not isinstance(msg, Query):
                raise ProtocolError("control connections may only QUERY")
            send(conn, Answer(self._answer(msg)))

    def _serve_push(self, conn: Conn, open_transfers: dict[str, StagedTransfer],
                    same_host: bool) -> None:
        """`same_host`: P connected from this host's own address (shm always does), so P's
        wall clock is D's and its `last_layer_s` may enter D's record."""
        staging = self._staging
        while True:
            msg = recv(conn)
            if isinstance(msg, Begin):
                tid = msg.transfer_id
                if staging is None:
                    send(conn, BeginRefused(tid, "not_a_decode_worker"))
                    continue
                self._faults.crash_if(tid, "d-begin")
                try:
                    st = staging.begin(tid, msg.tokens, msg.skip)
                except StagingRefused as exc:
                    send(conn, BeginRefused(tid, exc.cause))
                    continue
                open_transfers[tid] = st
                send(conn, BeginOk(tid, st.offset))
            elif isinstance(msg, Layer):
                layer_of = open_transfers.get(msg.transfer_id)
                if layer_of is None or staging is None:
                    raise ProtocolError("LAYER for a transfer that was not begun")
                self._receive_layer(conn, staging, layer_of, msg)
            elif isinstance(msg, End):
                ended = open_transfers.pop(msg.transfer_id, None)
                if ended is None or staging is None:
                    continue
                st = ended
                st.record.end_received_s = time.time()
                if msg.end_lag_s is not None:  # P's, for D's record
                    st.record.end_lag_s = float(msg.end_lag_s)
                if same_host and msg.last_layer_s is not None:
                    st.record.last_layer_s = float(msg.last_layer_s)
                if msg.wire_s is not None:
                    st.record.wire_s = float(msg.wire_s)
                ok = staging.end(st)
                staging.writer_done(st)
                send(conn, Ack(msg.transfer_id, ok, st.failed))
            elif isinstance(msg, Abort):
                aborted = open_transfers.pop(msg.transfer_id, None)
                if aborted is not None and staging is not None:
                    staging.fail(aborted, "aborted_by_prefill", TransferStatus.ABORTED)
                    staging.writer_done(aborted)
            else:
                raise ProtocolError(f"unexpected op {msg.OP!r} on a push connection")

    def _receive_layer(self, conn: Conn, staging: StagingArea, st: StagedTransfer,
                       msg: Layer) -> None:
        shape = st.shape
        layer, start, end = msg.layer, msg.start, msg.end
        valid = 0 <= layer < shape.num_layers and st.skip <= start < end <= st.num_tokens
        nbytes = (end - start) * shape.bytes_per_token_layer
        if not valid or msg.nbytes != nbytes:
            raise ProtocolError("LAYER frame does not match the transfer's shape")
        if st.chunks.setdefault(start, end) != end:
            raise ProtocolError("LAYER chunks overlap")
        view = staging.region(st, region_offset(shape, start, end, layer, st.skip), nbytes)
        if msg.inline:
            recv_exact_into(conn, view)
        if xxhash.xxh3_64_hexdigest(view) != msg.checksum:
            staging.fail(st, "checksum_mismatch")
            return
        written = msg.written_s
        staging.layer_received(st, layer, end - start,
                               float(written) if written is not None else None)
