"""P's side of the KV channel: one authenticated connection to one D, fed by a queue.

Contract (the swap point between transports):
- `push_layer` runs on the forward thread. Once a transfer is open it copies the layer's KV out
  of P's blocks right there (`stage_now`): the layer was just written, so it is hot in cache,
  and no thread switch or lock hand-over is paid per layer. Before that (BEGIN not yet answered),
  for transfers marked by test faults, or when the transport has no room, the sender thread
  copies it instead. The forward thread never does socket I/O: a sender thread sends everything.
- A transport decides how a LAYER's payload reaches D's staging region and when its frame
  leaves (`stage_now` on the forward thread, `write_payload` on the sender's: frame and payload
  sent by the sender, or a payload-less frame held in `SendState.unsent`, which goes out with
  END in one send); framing, handshake, BEGIN/END/ABORT and ACK handling are shared here.
  A copy that raises fails its transfer (D then recomputes), never the forward pass.
- The forward thread's copy goes through the channel's `Copier` (`devcopy`): on a CPU engine
  the synchronous copy, checksummed right there; on a CUDA engine it is queued on a side stream
  (`CopiedLayer`) and the sender thread waits for it before it checksums and sends, so the
  forward thread never waits for a device-to-host copy. The sender waits for a queued copy
  even when its transfer was settled meanwhile, before any later ABORT lets D free the region.
- Every transfer ends in exactly one `TransferStatus`: `complete` (D acknowledged it,
  verified), `failed` (refused, peer gone, D reported a failure, or no ACK in time), or
  `cancelled`. `SendState.settled` tells the worker when P's blocks may be freed: once settled,
  the channel never writes them and never copies from them again. Copies on the forward
  thread need no hand-over: `cancel` is called on that thread too (a device copy it queued
  before may still read the blocks; its bytes are dropped).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from abc import ABC, abstractmethod

from splitserve.common.vocab import TransferStatus
from splitserve.connector.devcopy import Copier, InlineCopies
from splitserve.connector.faults import Faults
from splitserve.connector.framing import ProtocolError, send_parts
from splitserve.connector.layout.staging_format import KVShape
from splitserve.connector.messages import (
    Abort,
    Ack,
    Begin,
    BeginOk,
    BeginRefused,
    End,
    Layer,
    StagingInfo,
    encode,
    recv,
    send,
)
from splitserve.connector.protocol import Fingerprint, PeerRefused, connect
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.tls import Conn
from splitserve.connector.transport.items import (
    AbortItem,
    BeginItem,
    CopiedLayer,
    EndItem,
    LayerItem,
    QueueItem,
    ReadyLayer,
    SendState,
)

log = logging.getLogger(__name__)
CONNECT_TRIES = 3
CONNECT_RETRY_S = 0.2  # the pause before try n+1 is n times this


class PushChannel(ABC):
    """Pushes transfers to one D listener over one connection (a `TransferChannel`)."""

    def __init__(self, host: str, port: int, token: str, fingerprint: Fingerprint,
                 stats: ConnectorStats, faults: Faults, shape: KVShape,
                 connect_timeout_s: float, begin_timeout_s: float = 5.0,
                 tls: ssl.SSLContext | None = None, copier: Copier | None = None) -> None:
        self.host, self.port = host, port
        self.copier = copier or InlineCopies()  # how the forward thread copies a layer out
        self._tls = tls  # set: every connection is TLS, verified for `host`
        self._token, self._fingerprint = token, fingerprint
        self._stats, self._faults = stats, faults
        self.shape = shape
        self._connect_timeout_s = connect_timeout_s
        self._begin_timeout_s = begin_timeout_s
        self._queue: queue.SimpleQueue[QueueItem | None] = queue.SimpleQueue()
        self._states: dict[str, SendState] = {}
        self._lock = threading.Lock()
        self._busy_with: str | None = None  # transfer id the sender is touching right now
        # held by the forward thread across its check of a transfer and its copy into D's
        # region (shm): once a transfer is settled, taking it waits out a copy in progress
        self._writing = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sock: Conn | None = None  # set by the sender thread; ended by either thread
        self._sending_on: Conn | None = None  # the sender thread's connection for its item
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"splitserve-push-{host}:{port}")
        self._sender.start()

    # -- called from the worker's main thread ----------------------------------------------
    def begin(self, transfer_id: str, num_tokens: int, nbytes: int, ack_timeout_s: float,
              skip: int = 0) -> SendState:
        """Open a transfer of the prompt tokens [skip, num_tokens) (`nbytes` of them)."""
        rec = self._stats.open(transfer_id, "send", num_tokens - skip, nbytes, skip)
        st = SendState(transfer_id, num_tokens, rec, time.monotonic() + ack_timeout_s, skip,
                       ack_timeout_s=ack_timeout_s)
        with self._lock:
            self._states[transfer_id] = st
        self._queue.put(BeginItem(st))
        return st

    def push_layer(self, item: LayerItem) -> None:
        """Called on the forward thread right after the layer's KV was written (see contract)."""
        st = self._states.get(item.transfer_id)
        if st is not None and not self._faults.marks(item.transfer_id):
            t0 = time.perf_counter()
            try:
                with self._writing:  # see `_quiesce`
                    staged = not st.settled and self.stage_now(st, item)
            except Exception:
                log.exception("KV copy of transfer %s failed", item.transfer_id)
                self._give_up(st, "internal_error")
                return
            if staged:
                st.record.copy_forward_s += time.perf_counter() - t0
                return
        self._queue.put(item)

    def _quiesce(self) -> None:
        """Return once the forward thread is not copying into D's regions. Called after the
        transfers concerned are settled (none of their copies starts any more) and before P
        lets D free their regions (its ABORT, its end of the connection), so no copy of the
        forward thread's lands in a region D has handed on. Not covered: device copies still
        queued (CUDA), and D ending the connection itself."""
        with self._writing:
            pass

    def queue_ready(self, ready: ReadyLayer) -> None:
        self._queue.put(ready)

    def queue_copied(self, copied: CopiedLayer) -> None:
        self._queue.put(copied)

    def end(self, transfer_id: str) -> None:
        """After the forward pass that computed the transfer's last chunk (every layer done).
        D has `ack_timeout_s` from now to acknowledge it, however long the prefill took."""
        st = self._states.get(transfer_id)
        if st is not None:
            st.record.last_layer_s = time.time()  # the end of P's last layer
            st.deadline = time.monotonic() + st.ack_timeout_s
        self._queue.put(EndItem(transfer_id))

    def cancel(self, transfer_id: str) -> None:
        """Stop touching the transfer's blocks; returns once the sender thread is off them,
        without waiting for a device copy queued earlier (its bytes are dropped)."""
        with self._lock:
            st = self._states.get(transfer_id)
            if st is not None and not st.settled:
                st.status = TransferStatus.CANCELLED
            if st is not None:
                st.began.set()  # a sender waiting for D's BEGIN_OK lets go of it now
            while self._busy_with == transfer_id:
                self._idle.wait(0.05)
        if st is not None:
            self._stats.close(st.record, TransferStatus.FAILED, "cancelled")
            self._queue.put(AbortItem(transfer_id))

    def poll(self, transfer_id: str) -> SendState | None:
        """The transfer's state; a pending one past its ACK deadline is failed here, and
        ABORTed after what is queued before it (its END will not go)."""
        st = self._states.get(transfer_id)
        if st is not None and not st.settled and time.monotonic() > st.deadline:
            self._give_up(st, "ack_timeout")
        return st

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._states.pop(transfer_id, None)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- transport-specific ----------------------------------------------------------------
    @abstractmethod
    def on_connected(self, staging_info: StagingInfo) -> None:
        """Prepare the payload path once the handshake succeeded (e.g. map D's segment)."""

    @abstractmethod
    def stage_now(self, st: SendState, item: LayerItem) -> bool:
        """On the forward thread: copy the chunk out of P's blocks and queue or hold its frame;
        False (nothing done) if the transport cannot yet, and the sender thread will."""

    @abstractmethod
    def send_copied(self, st: SendState, copied: CopiedLayer) -> None:
        """On the sender thread, once the forward thread's queued copy completed: checksum
        `copied.region` and send (or hold) its LAYER frame."""

    @abstractmethod
    def write_payload(self, sock: Conn, st: SendState, item: LayerItem) -> None:
        """On the sender thread: deliver the chunk's bytes into D's staging region and send
        (or hold) its LAYER frame."""

    # -- the sender thread -------------------------------------------------------------------
    def _ensure_connected(self) -> Conn:
        """The connection, opened (handshake done, payload path ready) if there is none. A
        connection that cannot be made (refused, reset, timed out) is tried `CONNECT_TRIES`
        times in all before it raises, while a transfer still waits to be sent; a refusal of
        the handshake or TLS is not retried."""
        sock = self._sock
        if sock is None:
            self._sending_on = None  # a connect that fails ends no connection
            for attempt in range(1, CONNECT_TRIES + 1):
                try:
                    sock = self._open_connection()
                    break
                except (ssl.SSLError, PeerRefused):
                    raise
                except OSError as exc:
                    with self._lock:  # nothing left to send (cancelled meanwhile): no retry
                        waiting = any(not st.settled for st in self._states.values())
                    if attempt == CONNECT_TRIES or self._closed or not waiting:
                        raise
                    log.warning("connecting to D at %s:%d failed (%r), try %d of %d", self.host,
                                self.port, exc, attempt, CONNECT_TRIES)
                    time.sleep(CONNECT_RETRY_S * attempt)
            assert sock is not None  # each try connects, raises, or is followed by another
            self._sock = sock
            threading.Thread(target=self._reply_loop, args=(sock,), daemon=True,
                             name=f"splitserve-acks-{self.host}:{self.port}").start()
        self._sending_on = sock
        return sock

    def _open_connection(self) -> Conn:
        sock, info = connect(self.host, self.port, self._token, "push", self._fingerprint,
                             self._connect_timeout_s, self._tls)
        try:
            self.on_connected(info)
        except BaseException:
            sock.close()  # D's thread for it ends
            raise
        return sock

    def _fail(self, st: SendState, cause: str) -> bool:
        """Fail `st` as `cause`; False if it was settled already (nothing changes)."""
        with self._lock:
            if st.settled:
                return False
            st.status = TransferStatus.FAILED
        st.began.set()
        self._stats.close(st.record, TransferStatus.FAILED, cause)
        return True

    def _give_up(self, st: SendState, cause: str) -> None:
        """Fail `st` as `cause` and queue its ABORT behind what is queued before it, so D
        frees its region now rather than when its lease runs out."""
        if self._fail(st, cause):
            self._queue.put(AbortItem(st.transfer_id))

    def _connection_lost(self, cause: str, sock: Conn | None,
                         error: BaseException | None = None) -> None:
        """`sock` (None: a connect that failed) ended: fail what is pending on it. The end of
        an older connection, already replaced, changes nothing."""
        with self._lock:
            if sock is not self._sock:
                return
            self._sock = None
            pending = [st for st in self._states.values() if not st.settled]
        for st in pending:  # settled before D can free their regions (`_quiesce`)
            self._fail(st, cause)
        if sock is not None:
            self._quiesce()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its reply thread ends with it
        if pending:
            log.warning("push channel to %s:%d %s (%s: %r): %d transfer(s) failed",
                        self.host, self.port, "lost" if sock is not None else "not connected",
                        cause, error, len(pending))

    def on_closed(self) -> None:
        """On the sender thread, once `close()` was called and every queued item (device
        copies included) was handled: release what the transport holds (nothing here)."""
        return None

    def _send_loop(self) -> None:
        try:
            self._drain_queue()
        finally:
            self.on_closed()

    def _drain_queue(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, AbortItem):
                self._abort(item.transfer_id)
                continue
            with self._lock:
                st = self._states.get(item.transfer_id)
                skip = st is None or st.settled
                if not skip and not isinstance(item, CopiedLayer):  # a device copy: no host read
                    self._busy_with = item.transfer_id
            if skip:
                if isinstance(item, CopiedLayer):  # the copy may still write its region
                    item.settle()
                elif isinstance(item, ReadyLayer):
                    item.release()
                continue
            assert st is not None
            self._sending_on = self._sock
            try:
                self._handle(item, st)
            except (OSError, ProtocolError) as exc:  # TLS: untrusted cert, wrong host, not TLS
                cause = ("tls_failed" if isinstance(exc, ssl.SSLError) else
                         "peer_refused" if isinstance(exc, PeerRefused) else "peer_unreachable")
                self._connection_lost(cause, self._sending_on, exc)
            except Exception:  # anything else (a copy that raised): this transfer alone fails
                log.exception("KV push of transfer %s failed on the sender thread",
                              item.transfer_id)
                self._give_up(st, "internal_error")
            finally:
                with self._lock:
                    self._busy_with = None
                    self._idle.notify_all()

    def _abort(self, transfer_id: str) -> None:
        """ABORT a transfer P gave up on (failed, cancelled, or already forgotten), so D frees
        its region now rather than when its lease runs out. Not while D has yet to answer its
        BEGIN: the reply loop queues the ABORT again when that BEGIN_OK comes. A forgotten
        transfer is ABORTed whatever D did with it (D ignores one it never opened)."""
        with self._lock:
            st = self._states.get(transfer_id)
        if st is not None:
            st.unsent.clear()
            if st.offset < 0:
                return
        sock = self._sock  # the reply thread may end it meanwhile
        if sock is None:
            return
        self._quiesce()  # D frees the region on ABORT
        try:
            send(sock, Abort(transfer_id))
        except OSError:
            self._connection_lost("peer_unreachable", sock)

    def _handle(self, item: QueueItem, st: SendState) -> None:
        match item:
            case BeginItem():
                self._send_begin(st)
            case LayerItem():
                self._send_layer(st, item)
            case ReadyLayer():
                try:
                    if st.offset >= 0:
                        t0 = time.perf_counter()
                        send_parts(self._ensure_connected(), item.parts)
                        st.record.sender_sends_s += time.perf_counter() - t0
                finally:
                    item.release()
            case CopiedLayer():
                self._send_copied(st, item)
            case EndItem():
                self._send_end(st)

    def _send_begin(self, st: SendState) -> None:
        if self._faults.drop(st.transfer_id):
            self._fail(st, "fault_drop")
            return
        send(self._ensure_connected(), Begin(st.transfer_id, st.num_tokens, st.skip))
        if not st.began.wait(self._begin_timeout_s):
            log.warning("D at %s:%d did not answer BEGIN of %s in %.1f s", self.host, self.port,
                        st.transfer_id, self._begin_timeout_s)
            self._fail(st, "begin_timeout")

    def _send_layer(self, st: SendState, item: LayerItem) -> None:
        if st.offset < 0 or self._faults.drop(st.transfer_id):
            return
        if self._faults.skip_layer(st.transfer_id, item.layer, self.shape.num_layers):
            return
        if delay := self._faults.delay_s(st.transfer_id):
            time.sleep(delay)
        self._faults.crash_if(st.transfer_id, "p-mid-push", item.layer, self.shape.num_layers)
        sock = self._ensure_connected()
        t0 = time.perf_counter()
        self.write_payload(sock, st, item)
        st.record.sender_layers_s += time.perf_counter() - t0

    def _send_copied(self, st: SendState, copied: CopiedLayer) -> None:
        t0 = time.perf_counter()
        if copied.settle(release=False):
            try:
                if st.offset >= 0 and not st.settled:
                    self.send_copied(st, copied)
            finally:
                copied.release()
        else:
            self._give_up(st, "internal_error")
        st.record.sender_layers_s += time.perf_counter() - t0

    def _send_end(self, st: SendState) -> None:
        if st.offset >= 0:
            rec = st.record
            rec.wire_s = rec.copy_forward_s + rec.sender_layers_s + rec.sender_sends_s
            if rec.last_layer_s is not None:
                rec.end_lag_s = max(0.0, time.time() - rec.last_layer_s)
            end = encode(End(st.transfer_id, rec.last_layer_s, rec.end_lag_s, rec.wire_s))
            send_parts(self._ensure_connected(), [*st.unsent, end])
        st.unsent.clear()

    def layer_frame(self, item: LayerItem, payload: memoryview, inline: bool = True,
                    written_s: float | None = None) -> Layer:
        """The LAYER message for `item`'s payload (checksummed here; wrong for a fault-marked
        layer)."""
        corrupt = self._faults.corrupt_layer(item.transfer_id, item.layer)
        return item.frame(payload, inline, written_s, corrupt)

    def _reply_loop(self, sock: Conn) -> None:
        try:
            while True:
                msg = recv(sock)
                if not isinstance(msg, BeginOk | BeginRefused | Ack):
                    raise ProtocolError(f"unexpected op {msg.OP!r} from a listener")
                with self._lock:
                    st = self._states.get(msg.transfer_id)
                    # under the lock: a cancel after this sees the offset and ABORTs itself
                    given_up = st is None or st.settled
                    if isinstance(msg, BeginOk) and st is not None:
                        st.offset = msg.offset
                if isinstance(msg, BeginOk):
                    if st is not None:
                        st.began.set()
                    if given_up:  # D opened it after P gave up on it
                        self._queue.put(AbortItem(msg.transfer_id))
                    continue
                if st is None:
                    continue
                elif isinstance(msg, BeginRefused):
                    self._fail(st, f"refused_{msg.cause}")
                elif msg.ok:
                    with self._lock:
                        acked = not st.settled
                        if acked:
                            st.status = TransferStatus.COMPLETE
                    if acked:
                        self._stats.close(st.record, TransferStatus.COMPLETE)
                else:
                    self._fail(st, msg.cause or "decode_rejected")
        except (OSError, ProtocolError):
            if not self._closed:
                self._connection_lost("peer_gone", sock)
        except Exception as exc:  # never a channel that looks connected with no reader
            log.exception("push channel to %s:%d: reading D's replies failed", self.host,
                          self.port)
            self._connection_lost("internal_error", sock, exc)
