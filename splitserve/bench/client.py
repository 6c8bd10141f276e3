"""The asyncio streaming load generator: sends a request stream, records every chunk.

`run_stream` sends each `Request` at its arrival offset (after any concurrency cap — a
request's clock starts when it is actually sent) as a streaming `/v1/completions` call with the
prompt as token ids, `ignore_eos` and `return_token_ids` (vLLM's; `vllm_extras=False` omits them
for servers that reject unknown fields). Each `RequestRecord` holds the send time, every chunk's
arrival time and token count, the HTTP status, the error (cause and message), the server's
`X-Request-Id`, and the server's per-leg timings when it reports them — in a response header
`X-Splitserve-Timings` (JSON), an SSE comment `: splitserve-timings {json}` (splitserve's
router) or a top-level `splitserve*` field of an SSE chunk, and the prompt tokens the server
reports as cached (`usage.prompt_tokens_details.cached_tokens`, vLLM with
`--enable-prompt-tokens-details`); where asked, the prompt's and the answer's token ids.

`BusySampler` polls each worker's Prometheus `/metrics` and reports the fraction of samples in
which the engine had requests running or waiting (its busy fraction).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from splitserve.bench.workload import Request
from splitserve.common.load import LOAD_PATH, parse_metrics
from splitserve.common.wire import WorkerLoad
from splitserve.config import bearer_headers

TIMINGS_HEADER = "x-splitserve-timings"


@dataclass
class RequestRecord:
    """What the client saw for one request. Times are seconds since the run's start."""

    index: int
    kind: str
    input_len: int
    requested_output_len: int
    scheduled_s: float
    send_s: float = 0.0
    end_s: float = 0.0  # when the response ended (success or failure)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    status: int | None = None
    # None when the request succeeded; else "http_<status>", "timeout", "connect", "stream"
    # (transport or parse error), "stream_error" (an error event), "empty", "truncated" or
    # "session" (multiturn: an earlier turn of its session failed, so it was not sent).
    error_cause: str | None = None
    error: str | None = None
    request_id: str | None = None
    server_timings: dict[str, Any] = field(default_factory=dict)
    usage_output_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (see above)
    session: int | None = None  # multiturn: the session and turn; mooncake: the prefix tree
    turn: int | None = None
    # Kept when asked for (multiturn keeps every answer's ids: the next turn resends them).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error_cause is None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**d)


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the endpoint."""

    url: str
    model: str | None = None  # default: the first model `/v1/models` lists
    api_key: str | None = None
    timeout_s: float = 600.0  # connect/write/pool
    read_timeout_s: float = 120.0  # longest silence between two reads of one response
    vllm_extras: bool = True
    run_tag: str = "bench"
    save_token_ids: bool = False  # records keep every prompt's and answer's token ids

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("timeout_s and read_timeout_s must be positive")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    def headers(self) -> dict[str, str]:
        return bearer_headers(self.api_key)


async def resolve_model(client: httpx.AsyncClient, cfg: ClientConfig) -> str:
    """The model name to send: `cfg.model`, else the first one the endpoint lists."""
    if cfg.model:
        return cfg.model
    resp = await client.get(f"{cfg.base}/v1/models", headers=cfg.headers())
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def _chunk_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if choice.get("text") else 0


def _absorb_chunk(rec: RequestRecord, data: dict[str, Any], now: float) -> None:
    for key, value in data.items():
        if key.startswith("splitserve") and isinstance(value, dict):
            rec.server_timings.update(value)
    if usage := data.get("usage"):
        rec.usage_output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]
    if "error" in data:
        rec.error_cause = rec.error_cause or "stream_error"
        rec.error = json.dumps(data["error"])[:500]
    choices = data.get("choices", [])
    if any(c.get("finish_reason") == "abort" for c in choices):  # vLLM's: ended unfinished
        rec.error_cause = rec.error_cause or "aborted"
        rec.error = rec.error or "the server aborted the request (finish_reason \"abort\")"
    if rec.output_token_ids is not None:
        for c in choices:
            if isinstance(c.get("token_ids"), list):
                rec.output_token_ids.extend(int(t) for t in c["token_ids"])
    n = sum(_chunk_tokens(c) for c in choices)
    if n:
        rec.chunk_times.append(now)
        rec.chunk_tokens.append(n)


def _absorb_comment(rec: RequestRecord, line: str) -> None:
    """An SSE comment `: splitserve-timings {json}` carries the server's per-leg timings."""
    name, _, payload = line[1:].strip().partition(" ")
    if name.startswith("splitserve") and payload.startswith("{"):
        try:
            rec.server_timings.update(json.loads(payload))
        except json.JSONDecodeError:
            pass


async def send_one(client: httpx.AsyncClient, cfg: ClientConfig, model: str, req: Request,
                   rec: RequestRecord, t0: float) -> None:
    """Send one request and fill `rec` in place. Never raises for a request-level failure."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.output_len,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
    }
    if cfg.vllm_extras:
        body |= {"ignore_eos": True, "return_token_ids": True}
    sent_id = f"{cfg.run_tag}-{req.index}"
    headers = cfg.headers() | {"X-Request-Id": sent_id}
    rec.send_s = time.perf_counter() - t0
    done = False
    try:
        async with client.stream("POST", f"{cfg.base}/v1/completions", json=body,
                                 headers=headers) as resp:
            rec.status = resp.status_code
            rec.request_id = resp.headers.get("x-request-id", sent_id)
            if resp.headers.get(TIMINGS_HEADER):
                rec.server_timings.update(json.loads(resp.headers[TIMINGS_HEADER]))
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error_cause, rec.error = f"http_{resp.status_code}", text[:500]
                rec.end_s = time.perf_counter() - t0
                return
            async for line in resp.aiter_lines():
                now = time.perf_counter() - t0
                if done:  # read to the body's end, so the connection goes back to the pool
                    continue
                if line.startswith(":"):
                    _absorb_comment(rec, line)
                    continue
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done, rec.end_s = True, now
                    continue
                _absorb_chunk(rec, json.loads(payload), now)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        if not done:  # past [DONE] the answer is whole: only its connection is lost
            rec.error_cause = ("timeout" if isinstance(exc, httpx.TimeoutException) else
                               "connect" if isinstance(exc, httpx.ConnectError) else "stream")
            rec.error = repr(exc)
    if not done:
        rec.end_s = time.perf_counter() - t0
    if rec.error_cause is None and not rec.chunk_times:
        rec.error_cause, rec.error = "empty", "stream ended without any token"
    elif rec.error_cause is None and not done:
        rec.error_cause, rec.error = "truncated", "stream closed before [DONE]"


def new_record(req: Request, keep_output: bool = False, keep_prompt: bool = False
               ) -> RequestRecord:
    """An empty record of `req`; `keep_output` / `keep_prompt`: it keeps the answer's token
    ids (vLLM's `return_token_ids`) / the prompt's."""
    return RequestRecord(index=req.index, kind=req.kind, input_len=req.input_len,
                         requested_output_len=req.output_len, scheduled_s=req.arrival_s,
                         session=req.session, turn=req.turn,
                         prompt_token_ids=list(req.prompt_token_ids) if keep_prompt else None,
                         output_token_ids=[] if keep_output else None)


@asynccontextmanager
async def http_client(cfg: ClientConfig, given: httpx.AsyncClient | None = None,
                      transport: httpx.AsyncBaseTransport | None = None
                      ) -> AsyncIterator[httpx.AsyncClient]:
    """`given` when there is one (the caller's, left open), else a run's own client: no cap on
    connections, `cfg`'s timeouts, closed on exit. One client for the warm-up and the run
    means the run's first requests go over the warm-up's connections."""
    if given is not None:
        yield given
        return
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0, read=cfg.read_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        yield client


async def warm_up(client: httpx.AsyncClient, cfg: ClientConfig, warmup: list[Request]) -> str:
    """Resolve the model name and send the `warmup` requests (awaited, not recorded)."""
    model = await resolve_model(client, cfg)
    w0 = time.perf_counter()
    await asyncio.gather(*(send_one(client, cfg, model, w, new_record(w), w0) for w in warmup))
    return model


async def run_stream(cfg: ClientConfig, requests: list[Request],
                     max_concurrency: int | None = None,
                     on_done: Callable[[RequestRecord], None] | None = None,
                     http: httpx.AsyncClient | None = None,
                     ) -> tuple[list[RequestRecord], float]:
    """Send `requests` at their arrival offsets (a warm-up is the caller's: `warm_up`), over
    `http` when given (see `http_client`).

    Returns the records of the measured requests (in stream order) and the run's duration in
    seconds: from the first scheduled send to the last response's end (the tail drain included).
    """
    async with http_client(cfg, http) as client:
        model = await resolve_model(client, cfg)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        keep = cfg.save_token_ids
        records = [new_record(r, keep, keep) for r in requests]
        t0 = time.perf_counter()

        async def one(req: Request, rec: RequestRecord) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await send_one(client, cfg, model, req, rec, t0)
            else:
                async with sem:
                    await send_one(client, cfg, model, req, rec, t0)
            if on_done is not None:
                on_done(rec)

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records, strict=True)))
        return records, time.perf_counter() - t0


def parse_load(metrics_text: str) -> tuple[float, float]:
    """(requests running, requests waiting) from a vLLM `/metrics` page, summed over engines."""
    load = parse_metrics(metrics_text)
    return load.running or 0.0, load.waiting or 0.0


PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
# vLLM's NixlConnector's histograms (on the worker that pulls: D), observed once per transfer
NIXL_SERIES = {"count": "vllm:nixl_xfer_time_seconds_count",
               "xfer_s": "vllm:nixl_xfer_time_seconds_sum",
               "post_s": "vllm:nixl_post_time_seconds_sum",
               "bytes": "vllm:nixl_bytes_transferred_sum"}

# vLLM's speculative-decoding counters (on the workers that draft: D and colocated)
SPEC_SERIES = {"drafts": "vllm:spec_decode_num_drafts_total",
               "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
               "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def parse_sum(metrics_text: str, name: str) -> float | None:
    """The sum of a Prometheus series over its label sets (None when absent)."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except ValueError:
                continue
    return total if found else None


def parse_busy(metrics_text: str) -> bool:
    """True when a vLLM `/metrics` page shows requests running or waiting."""
    return sum(parse_load(metrics_text)) > 0


class BusySampler:
    """Samples workers' load every `interval_s` while a run is in progress: a splitserve
    worker's light `/splitserve/load`, a plain vLLM worker's `/metrics` (after a 404); rendering
    `/metrics` costs the engine's core ~4 ms, so it is read once more per run only for the
    prefill seconds, at the start and at the stop.

    Busy fraction: the larger of (a) the share of samples in which the engine had a request
    running or waiting (occupancy; for a decode engine not the same as utilisation) and (b) the
    engine's prefill seconds (`vllm:request_prefill_time_seconds_sum`) over the run's wall time —
    a prefill-only request starts and ends inside one engine step, between two gauge updates,
    so (a) never sees a prefill worker busy. Queued fraction: the share of samples with a request
    waiting; a saturated engine queues most of the time. NIXL transfers: from the same two reads,
    what vLLM's NixlConnector counted in the run (`nixl_transfers`)."""

    def __init__(self, worker_urls: dict[str, str], interval_s: float = 0.1,
                 token: str | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._headers = bearer_headers(token)
        self._urls = {name: url.rstrip("/") for name, url in worker_urls.items()}
        self._paths = dict.fromkeys(self._urls, LOAD_PATH)
        self._interval = interval_s
        self._busy = dict.fromkeys(self._urls, 0)
        self._queued = dict.fromkeys(self._urls, 0)
        self._first: dict[str, dict[str, float]] = {}  # /metrics series sums at the start
        self._last: dict[str, dict[str, float]] = {}  # and at the stop
        self._t0 = self._t1 = 0.0
        self._samples = dict.fromkeys(self._urls, 0)
        self._task: asyncio.Task[None] | None = None

    async def _read_metrics(self, client: httpx.AsyncClient,
                            into: dict[str, dict[str, float]]) -> None:
        for name, url in self._urls.items():
            try:
                resp = await client.get(f"{url}/metrics")
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                into[name] = {series: s for series in (PREFILL_SECONDS, *NIXL_SERIES.values(),
                                                       *SPEC_SERIES.values())
                              if (s := parse_sum(resp.text, series)) is not None}

    async def _sample(self, client: httpx.AsyncClient, name: str) -> WorkerLoad | None:
        """The worker's load now; None when it gave none (e.g. 401). WireError: malformed."""
        url = self._urls[name]
        resp = await client.get(f"{url}{self._paths[name]}")
        if resp.status_code == 404 and self._paths[name] == LOAD_PATH:
            self._paths[name] = "/metrics"  # plain vLLM: no splitserve routes
            resp = await client.get(f"{url}/metrics")
        if resp.status_code != 200:  # e.g. 401: no sample, not an idle one
            return None
        if self._paths[name] == LOAD_PATH:
            return WorkerLoad.from_json(resp.json())
        return parse_metrics(resp.text)

    async def _loop(self) -> None:
        async with httpx.AsyncClient(timeout=5.0, headers=self._headers) as client:
            await self._read_metrics(client, self._first)
            while True:
                for name in self._urls:
                    try:
                        load = await self._sample(client, name)
                    except (httpx.HTTPError, ValueError):  # ValueError: not JSON, or WireError
                        continue
                    if load is None:
                        continue
                    running, waiting = load.running or 0.0, load.waiting or 0.0
                    self._samples[name] += 1
                    self._busy[name] += running + waiting > 0
                    self._queued[name] += waiting > 0
                self._t1 = time.perf_counter()
                await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._urls:
            self._t0 = time.perf_counter()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            async with httpx.AsyncClient(timeout=5.0, headers=self._headers) as client:
                await self._read_metrics(client, self._last)
            self._t1 = time.perf_counter()
        occupancy = self._fractions(self._busy)
        wall = self._t1 - self._t0
        for name, first in self._first.items():
            last = self._last.get(name, {})
            if wall > 0 and PREFILL_SECONDS in first and PREFILL_SECONDS in last:
                share = min(1.0, (last[PREFILL_SECONDS] - first[PREFILL_SECONDS]) / wall)
                occupancy[name] = share if math.isnan(occupancy[name]) else max(
                    occupancy[name], share)
        return occupancy

    def queued(self) -> dict[str, float]:
        return self._fractions(self._queued)

    def nixl_transfers(self) -> dict[str, dict[str, float]]:
        """Per worker that pulled KV over NIXL during the run (read after `stop`): the number
        of transfers, their mean duration and post time (ms) and mean bytes, from vLLM's
        `vllm:nixl_*` histograms. vLLM keeps no per-request record of a NIXL transfer."""
        out: dict[str, dict[str, float]] = {}
        for name, first in self._first.items():
            last = self._last.get(name, {})
            delta = {key: last[series] - first.get(series, 0.0)
                     for key, series in NIXL_SERIES.items() if series in last}
            count = delta.get("count", 0.0)
            if count > 0:
                out[name] = {"transfers": count,
                             "mean_xfer_ms": delta.get("xfer_s", 0.0) / count * 1e3,
                             "mean_post_ms": delta.get("post_s", 0.0) / count * 1e3,
                             "mean_bytes": delta.get("bytes", 0.0) / count}
        return out

    def spec_decode(self) -> dict[str, dict[str, float]]:
        """Per worker that drafted during the run (read after `stop`): drafts, draft tokens and
        accepted tokens from vLLM's `vllm:spec_decode_*` counters, the acceptance rate
        (accepted / draft tokens) and the mean accepted tokens per draft."""
        out: dict[str, dict[str, float]] = {}
        for name, first in self._first.items():
            last = self._last.get(name, {})
            delta = {key: last[series] - first.get(series, 0.0)
                     for key, series in SPEC_SERIES.items() if series in last}
            if delta.get("drafts", 0.0) > 0:
                out[name] = delta | spec_rates(delta)
        return out

    def _fractions(self, counts: dict[str, int]) -> dict[str, float]:
        return {n: (counts[n] / self._samples[n]) if self._samples[n] else float("nan")
                for n in self._urls}


def spec_rates(counts: dict[str, float]) -> dict[str, float]:
    """Acceptance rate (accepted / draft tokens) and accepted tokens per draft of counts with
    `drafts`, `draft_tokens` and `accepted_tokens`."""
    drafts, proposed = counts.get("drafts", 0.0), counts.get("draft_tokens", 0.0)
    accepted = counts.get("accepted_tokens", 0.0)
    return {"acceptance_rate": accepted / proposed if proposed else float("nan"),
            "accepted_per_draft": accepted / drafts if drafts else float("nan")}
