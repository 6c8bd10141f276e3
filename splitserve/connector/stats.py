"""Connector metrics: counters in aggregate and one record per transfer, in the worker process.

Read through the listener's QUERY op (so they are observable while the engine is idle) as the
wire types `TransferCounters` and `wire.TransferRecord`, and exported by the worker plugin as
Prometheus families `splitserve_kv_*`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import asdict, dataclass, field, replace

from splitserve.common import wire
from splitserve.common.vocab import TransferStatus
from splitserve.connector.ranks import transfer_of

MAX_RECORDS = 4096


@dataclass
class TransferRecord:
    """One transfer as seen by this worker (`side` "recv" on D, "send" on P), as it goes; its
    wire form is `to_wire()`."""

    transfer_id: str
    side: str
    tokens: int = 0  # prompt tokens moved (sent on P, staged on D)
    bytes: int = 0  # KV bytes moved
    skipped_tokens: int = 0  # the prompt's prefix not moved: D's prefix cache was to hold it
    status: TransferStatus = TransferStatus.OPEN  # open -> complete -> a terminal status
    cause: str | None = None
    started_s: float = field(default_factory=time.time)
    first_byte_s: float | None = None
    complete_s: float | None = None
    load_s: float | None = None  # D: seconds to copy staged KV into vLLM's blocks
    loaded_tokens: int | None = None  # D: tokens copied (fewer when D had a prefix-cache hit)
    load_mode: str | None = None  # D: "sync" (complete when scheduled) or "async" (waited)
    # D: wall time (epoch s) its scheduler took the decode leg (gave it blocks); the router's
    # `d_wait_s` is this minus the leg's sending
    scheduled_s: float | None = None
    # P: seconds spent copying this transfer's KV out of P's blocks (gather and checksum) on the
    # forward thread (on the forward pass's path); and on its layers by the sender thread
    # (copies before BEGIN was answered or for fault-marked transfers; tcp: their sends too)
    copy_forward_s: float = 0.0
    sender_layers_s: float = 0.0
    sender_sends_s: float = 0.0  # P, tcp: the sender putting forward-copied layers on the socket
    # Wall time (epoch s) the forward pass of the last chunk ended (vLLM's wait_for_save, before
    # the logits): the end of P's last layer. P stamps it; D takes it from END only when P is on
    # its host (the same clock).
    last_layer_s: float | None = None
    # P: seconds from the end of its last layer to END going out (P's clock); D takes it from
    # END. D: wall time END was read (D's clock).
    end_lag_s: float | None = None
    end_received_s: float | None = None
    # Seconds the bytes were actually moving: P's copies (forward thread and sender) plus the
    # sender's sends, summed when END goes out; D takes it from END.
    wire_s: float | None = None

    def to_wire(self) -> wire.SideRecord:
        """The record as it stands, plus `duration_s` (BEGIN to verified END on this worker's clock:
        includes P's prefill, since layers move while P computes), `tail_s` (what the overlap
        leaves exposed: the end of P's last layer to the transfer's end, on one clock when P and
        D share a host, and on P itself; on a D whose P is on another host, P's `end_lag_s` plus
        END's reading to its verification: a lower bound that leaves out the frames D had not
        read yet when END went out and END's own trip, with no common clock needed) and `gbps`
        (bytes / `wire_s`: the rate while bytes move)."""
        end = self.complete_s
        if end and self.last_layer_s:
            tail: float | None = end - self.last_layer_s
        elif end and self.end_lag_s is not None and self.end_received_s:
            tail = self.end_lag_s + (end - self.end_received_s)
        else:
            tail = None
        return wire.SideRecord(**asdict(self), duration_s=(end - self.started_s) if end else None,
                               tail_s=tail,
                               gbps=self.bytes / self.wire_s / 1e9 if self.wire_s else None)


class ConnectorStats:
    """Thread-safe counters and a bounded table of recent transfer records."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: OrderedDict[tuple[str, str], TransferRecord] = OrderedDict()
        self.counts: Counter[str] = Counter()  # "<side>_<status>"
        self.failures: Counter[str] = Counter()  # cause -> count
        self.bytes_total: Counter[str] = Counter()  # side -> bytes
        # side -> seconds of completed transfers
        self.seconds_total: defaultdict[str, float] = defaultdict(float)

    def open(self, transfer_id: str, side: str, tokens: int, nbytes: int, skipped: int = 0
             ) -> TransferRecord:
        """A new record: `tokens` and `nbytes` moved, after `skipped` prompt tokens not moved."""
        rec = TransferRecord(transfer_id, side, tokens=tokens, bytes=nbytes,
                             skipped_tokens=skipped)
        with self._lock:
            self._records[(side, transfer_id)] = rec
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
        return rec

    def get(self, transfer_id: str, side: str) -> TransferRecord | None:
        with self._lock:
            return self._records.get((side, transfer_id))

    def close(self, rec: TransferRecord, status: TransferStatus, cause: str | None = None
              ) -> None:
        """Move a record forward: open -> complete -> a terminal status (`TransferStatus`).
        A terminal status is final: later calls change nothing.

        Each record is counted once per status it reaches, and a failure once with its cause.
        """
        status = TransferStatus(status)
        with self._lock:
            if rec.status.terminal or rec.status == status:
                return
            if rec.status == TransferStatus.OPEN:
                rec.complete_s = time.time()
                if status in (TransferStatus.COMPLETE, TransferStatus.LOADED):
                    self.bytes_total[rec.side] += rec.bytes
                    self.seconds_total[rec.side] += rec.complete_s - rec.started_s
            rec.status = status
            self.counts[f"{rec.side}_{status.value}"] += 1
            if cause:
                rec.cause = cause
                self.failures[cause] += 1

    def snapshot(self) -> wire.TransferCounters:
        with self._lock:
            return wire.TransferCounters(dict(self.counts), dict(self.failures),
                                         dict(self.bytes_total), dict(self.seconds_total))

    def record(self, transfer_id: str) -> wire.TransferRecord | None:
        """This worker's records of one transfer (one per side it took part as), or None. A
        rank that moved the transfer as pieces (`connector.ranks`) answers for them as one:
        the bytes summed, a failed piece's record if any failed, else the last to complete."""
        with self._lock:
            sides = {side: r.to_wire() for (side, t), r in self._records.items()
                     if t == transfer_id}
            pieces: dict[str, list[wire.SideRecord]] = {}
            for (side, t), r in self._records.items():
                if not sides and transfer_of(t) == transfer_id:
                    pieces.setdefault(side, []).append(r.to_wire())
        for side, recs in pieces.items():
            failed = [r for r in recs if r.status == TransferStatus.FAILED]
            last = failed[0] if failed else max(recs, key=lambda r: r.complete_s or 0.0)
            sides[side] = replace(last, transfer_id=transfer_id,
                                  bytes=sum(r.bytes for r in recs))
        if not sides:
            return None
        return wire.TransferRecord(transfer_id, **sides)
