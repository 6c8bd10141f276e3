"""Per-request token times of a simulated run, as the benchmark's `RequestRecord`s, so that the
benchmark's report plots (ITL over time, ITL and TTFT CDFs) show simulated runs beside measured
ones. Built from the decode segments: every step's end time on every worker, looked up by each
request's worker and join step. Meant for runs of up to some tens of thousands of requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splitserve.bench.client import RequestRecord
from splitserve.sim.deployment import SimOutcome

MAX_RECORDS = 20_000


def token_times(o: SimOutcome) -> list[np.ndarray]:
    """For each request, the times its tokens reach the client (t1 first); empty if failed."""
    k = o.seg_k
    idx = np.repeat(np.arange(len(k)), k)
    j = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    ends = o.seg_t0[idx] + o.seg_alpha[idx] * (j + 1) + o.seg_beta[idx] * j * (j + 1) / 2
    big = int(max(int(o.seg_step0.max(initial=0) + k.max(initial=0)), 1)) + 1
    keys = o.seg_worker[idx] * big + o.seg_step0[idx] + j + 1
    order = np.argsort(keys, kind="stable")
    keys, ends = keys[order], ends[order]
    out = []
    for r in range(len(o.arrivals)):
        if o.failed[r] or not np.isfinite(o.first_token[r]):
            out.append(np.empty(0))
            continue
        n = int(o.output_lens[r]) - 1
        if n == 0:
            out.append(np.array([o.first_token[r]]))
            continue
        want = o.decode_worker[r] * big + o.join_step[r] + np.arange(1, n + 1)
        pos = np.searchsorted(keys, want)
        if pos.max() >= len(keys) or not np.array_equal(keys[pos], want):
            raise AssertionError(f"request {r}: decode steps missing from the segment record")
        out.append(np.concatenate([[o.first_token[r]], ends[pos]]))
    return out


def request_records(o: SimOutcome) -> list[RequestRecord]:
    """The run as the benchmark's per-request records (times since the run start)."""
    if len(o.arrivals) > MAX_RECORDS:
        raise ValueError(f"per-request records are for runs of up to {MAX_RECORDS} requests")
    recs = []
    for r, times in enumerate(token_times(o)):
        rec = RequestRecord(index=r, kind="normal", input_len=int(o.prompt_lens[r]),
                            requested_output_len=int(o.output_lens[r]),
                            scheduled_s=float(o.arrivals[r]), send_s=float(o.arrivals[r]),
                            chunk_times=[float(t) for t in times],
                            chunk_tokens=[1] * len(times), status=200 if len(times) else None,
                            usage_output_tokens=len(times) or None)
        if not len(times):
            rec.error_cause, rec.error = "kv_capacity", "request can never fit in KV memory"
        recs.append(rec)
    return recs


TIMELINE_FIELDS = ("index", "kind", "input_len", "requested_output_len", "scheduled_s", "send_s",
                   "end_s", "chunk_times")


def timeline(recs: list[RequestRecord]) -> list[dict[str, Any]]:
    """The fields of measured records that the probes' readers use (`interference.gap_rows`,
    `validate.handovers`), times rounded to 1 µs: what a calibrated profile keeps of its
    probes, so that their terms can be derived again offline (`RequestRecord.from_dict`
    reads them back)."""
    out = []
    for rec in recs:
        d = {k: getattr(rec, k) for k in TIMELINE_FIELDS}
        for k in ("scheduled_s", "send_s", "end_s"):
            d[k] = round(d[k], 6)
        d["chunk_times"] = [round(t, 6) for t in rec.chunk_times]
        out.append(d)
    return out
