"""One request's clock and transfer record, as the `X-Splitserve-Timings` header, the stream's
closing comment and the router's histograms report them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.common.wire import SideRecord

if TYPE_CHECKING:
    from splitserve.router.legs import Transfer


@dataclass
class Timings:
    """One request's clock (monotonic seconds) and transfer record."""

    received: float = field(default_factory=time.monotonic)
    mode: str = "split"
    prefill_url: str | None = None
    decode_url: str | None = None
    transfer_id: str | None = None
    p_sent: float | None = None
    p_sent_wall: float | None = None
    t1_back: float | None = None
    first_sent: float | None = None
    d_sent: float | None = None
    d_sent_wall: float | None = None  # d_sent as epoch seconds, for the leg that loads KV
    d_first: float | None = None
    t2_sent: float | None = None
    end: float | None = None
    retries: int = 0
    kv: SideRecord | None = None  # D's record of the transfer (its connector's)
    cached: dict[str, int] | None = None  # the index's prediction: p_cached, d_cached tokens
    d_usage: dict[str, Any] | None = None  # the usage in D's stream (its last one)
    # D's stream: its chunks that carried tokens, and those tokens; one chunk is one or more
    # engine steps' output, so more than one token a chunk shows drafts accepted (or a slow
    # reader: vLLM merges the steps a reader has not taken yet)
    d_chunks: int = 0
    d_tokens: int = 0
    transfer: Transfer | None = field(default=None, repr=False)  # the last P attempt's
    # the transfer's record, fetched while D streams (started at its first token: by then the KV
    # is loaded), so the record costs the end of the request no round trip
    record_fetch: asyncio.Task[None] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        def gap(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 6)

        out: dict[str, Any] = {
            "mode": self.mode, "prefill": self.prefill_url, "decode": self.decode_url,
            "transfer_id": self.transfer_id, "retries": self.retries,
            "p_leg_s": gap(self.p_sent, self.t1_back),
            "ttft_s": gap(self.received, self.first_sent),
            "handover_s": gap(self.first_sent, self.t2_sent),
            "d_queue_s": gap(self.d_sent, self.d_first),
            "e2e_s": gap(self.received, self.end),
        }
        if self.d_chunks:
            out["d_tokens_per_chunk"] = round(self.d_tokens / self.d_chunks, 3)
        if self.cached:
            out.update(self.cached)
        kv = self.kv
        if kv is not None:
            out.update(kv_bytes=kv.bytes, kv_skipped_tokens=kv.skipped_tokens,
                       kv_transfer_s=kv.duration_s, kv_tail_s=kv.tail_s, kv_wire_s=kv.wire_s,
                       kv_gbps=kv.gbps, kv_load_s=kv.load_s, kv_status=kv.status.value)
            if kv.first_byte_s is not None and self.p_sent_wall is not None:
                out["p_queue_s"] = round(kv.first_byte_s - self.p_sent_wall, 6)
            if kv.scheduled_s is not None and self.d_sent_wall is not None:
                # D's intake (HTTP, the engine's queue) and the wait for D's step in progress
                out["d_wait_s"] = round(kv.scheduled_s - self.d_sent_wall, 6)
        return out
