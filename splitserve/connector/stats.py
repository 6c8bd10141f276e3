"""Connector metrics: counters in aggregate and one record per transfer, in the worker process.

Read through the listener's QUERY op (so they are observable while the engine is idle) and
exported by the worker plugin as Prometheus families `splitserve_kv_*`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_RECORDS = 4096
TERMINAL = frozenset({"loaded", "failed", "expired", "discarded"})


@dataclass
class TransferRecord:
    """One transfer as seen by this worker (`side` "recv" on D, "send" on P)."""

    transfer_id: str
    side: str
    tokens: int = 0
    bytes: int = 0
    status: str = "open"  # open -> complete -> loaded | failed | expired | aborted
    cause: str | None = None
    started_s: float = field(default_factory=time.time)
    first_byte_s: float | None = None
    complete_s: float | None = None
    load_s: float | None = None  # D: seconds to copy staged KV into vLLM's blocks
    loaded_tokens: int | None = None  # D: tokens copied (fewer when D had a prefix-cache hit)
    load_mode: str | None = None  # D: "sync" (complete when scheduled) or "async" (waited)
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

    def as_dict(self) -> dict[str, Any]:
        """The record plus `duration_s` (BEGIN to verified END on this worker's clock:
        includes P's prefill, since layers move while P computes), `tail_s` (what the overlap
        leaves exposed: the end of P's last layer to the transfer's end, on one clock when P and
        D share a host, and on P itself; on a D whose P is on another host, P's `end_lag_s` plus
        END's reading to its verification: a lower bound that leaves out the frames D had not
        read yet when END went out and END's own trip, with no common clock needed) and `gbps`
        (bytes / `wire_s`: the rate while bytes move)."""
        d = asdict(self)
        end = self.complete_s
        d["duration_s"] = (end - self.started_s) if end else None
        if end and self.last_layer_s:
            d["tail_s"] = end - self.last_layer_s
        elif end and self.end_lag_s is not None and self.end_received_s:
            d["tail_s"] = self.end_lag_s + (end - self.end_received_s)
        else:
            d["tail_s"] = None
        d["gbps"] = self.bytes / self.wire_s / 1e9 if self.wire_s else None
        return d


class ConnectorStats:
    """Thread-safe counters and a bounded table of recent transfer records."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: OrderedDict[tuple[str, str], TransferRecord] = OrderedDict()
        self.counts: Counter[str] = Counter()  # "<side>_<status>"
        self.failures: Counter[str] = Counter()  # cause -> count
        self.bytes_total: Counter[str] = Counter()  # side -> bytes
        self.seconds_total: Counter[str] = Counter()  # side -> seconds of completed transfers

    def open(self, transfer_id: str, side: str, tokens: int, nbytes: int) -> TransferRecord:
        rec = TransferRecord(transfer_id, side, tokens=tokens, bytes=nbytes)
        with self._lock:
            self._records[(side, transfer_id)] = rec
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
        return rec

    def get(self, transfer_id: str, side: str) -> TransferRecord | None:
        with self._lock:
            return self._records.get((side, transfer_id))

    def close(self, rec: TransferRecord, status: str, cause: str | None = None) -> None:
        """Move a record forward: open -> complete -> a terminal status. Terminal is final.

        Each record is counted once per status it reaches, and a failure once with its cause.
        """
        with self._lock:
            if rec.status in TERMINAL or rec.status == status:
                return
            if rec.status == "open":
                rec.complete_s = time.time()
                if status == "complete" or status == "loaded":
                    self.bytes_total[rec.side] += rec.bytes
                    self.seconds_total[rec.side] += rec.complete_s - rec.started_s
            rec.status = status
            self.counts[f"{rec.side}_{status}"] += 1
            if cause:
                rec.cause = cause
                self.failures[cause] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "counts": dict(self.counts),
                "failures": dict(self.failures),
                "bytes_total": dict(self.bytes_total),
                "seconds_total": dict(self.seconds_total),
            }

    def record(self, transfer_id: str) -> dict[str, Any] | None:
        with self._lock:
            recs = [r.as_dict() for (s, t), r in self._records.items() if t == transfer_id]
        if not recs:
            return None
        return {"transfer_id": transfer_id, **{r["side"]: r for r in recs}}
