"""The two legs, and the unsplit path.

Split: P gets the prompt with `max_tokens: 1` and the `kv_transfer_params` of the pair's
connector (`legs.LegProtocol`: what P is sent, what D needs of P's answer, what D is sent, how
an abandoned transfer is released); t1 goes to the client the moment P answers; D continues
from prompt + [t1] and streams the rest. A request that finishes at t1 never touches D.
Retries: P on another P with a fresh transfer id before t1; D, if it fails before finishing, is
resumed on another D with prompt + every token already produced (recomputed there, so nothing
stale is read), and the client sees one unbroken stream. Closing a leg's HTTP stream aborts
that request in vLLM, so cancelling the client's task aborts whichever leg is open.
A connector whose legs go at once (`LegProtocol.concurrent`: Mooncake) has D's first leg sent
with P's (`early.EarlyDecode`): D waits for P's KV itself and generates t1 again, which is
checked against the client's and dropped; a failed P attempt, a request ending at t1 and a
client gone before D close that leg.

Both legs go over the app's one aiohttp session (`http.new_session`), whose default headers
carry the deployment token: every request to a worker is authenticated. The unsplit path (one
worker, the request unchanged) is `whole.Passthrough`.

Cache (`plan`): with the router's cache view (`cacheview.CacheView`), the policies see each
synced worker's cached prefix of the prompt (`RouteRequest.cached`); D is chosen first, and
when it holds all but at most `local_prefill_max_tokens` of the prompt the request is D's leg
alone, from the prompt (prefill on D: `local`; no P leg, no transfer; resumed on another D like
any D leg). Otherwise P's leg counts only the tokens P
still computes as queued there, and the leg protocol is told D's cached prefix (`d_cached`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from splitserve.common.vocab import Pool
from splitserve.router.answer import PrefillAnswer
from splitserve.router.cacheview import CacheView
from splitserve.router.config import RouterConfig
from splitserve.router.early import EarlyDecode
from splitserve.router.failures import (
    RETRYABLE_STATUS,
    LegFailed,
    Retry,
    UpstreamError,
    exhausted,
    upstream_body,
)
from splitserve.router.formats import Joiner
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.legs import DecodeStart, LegProtocols, Transfer
from splitserve.router.metrics import RouterMetrics
from splitserve.router.params import Legs, decode_body, prefill_body
from splitserve.router.policy import NoWorker, Picker
from splitserve.router.registry import Registry
from splitserve.router.relay import relay
from splitserve.router.timings import Timings
from splitserve.router.worker import Worker
from splitserve.routing import RouteRequest
from splitserve.routing.prefix import prefill_on_d

log = logging.getLogger("splitserve.router")
JSON_HEADERS = {"Content-Type": "application/json"}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class Plan:
    """Where a request that may be split goes: the request as the policies see it, the D
    chosen for it (None for a request of one token: it ends at t1 on P and moves no KV), D's
    cached prefix of the prompt (as the index predicts: a multiple of D's block size; 0: none
    or not known), and whether it runs whole on that D (`local`: prefill on D) and then how
    many prompt tokens D reuses."""

    request: RouteRequest
    decode: Worker | None
    d_cached: int = 0
    local: bool = False
    local_reused: int = 0


@dataclass
class Prefilled:
    """P's answer. While `reserved`, this request holds one open leg on `decode` (taken when D
    was chosen); `Flow.decode` takes the reservation over, `Flow.release` drops it unused."""

    prompt_ids: list[int]
    t1_text: str
    t1_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    fingerprint: str | None
    decode: Worker | None  # the D the KV went to (None when the request ended at t1)
    transfer: Transfer | None  # the KV handoff D's first leg claims; None: D recomputes
    reserved: bool = True
    early: EarlyDecode | None = None  # D's first leg, sent with P's (a concurrent protocol)


def abandon(tr: Transfer | None, early: EarlyDecode | None) -> None:
    """No D leg will claim `tr`: close the D leg sent with P's (if any), then release it."""
    if early is not None:
        early.abort()
    if tr is not None:
        tr.via.release(tr)


class Flow:
    def __init__(self, cfg: RouterConfig, registry: Registry, picker: Picker,
                 metrics: RouterMetrics, session: aiohttp.ClientSession, model: str,
                 kv_bytes_per_token: int, max_model_len: int | None,
                 protocols: LegProtocols, cache: CacheView | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.picker = picker
        self.metrics = metrics
        self.session = session  # its default headers authenticate every request to a worker
        self.model = model
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_model_len = max_model_len
        self.protocols = protocols  # each connector's side of the legs
        self.cache = cache  # every worker's cached blocks, as their reports say (None: blind)

    # --- P ----------------------------------------------------------------------------------
    def route_request(self, legs: Legs) -> RouteRequest:
        """What the policies see of this request: P's prompt ids when the router knows them as
        its cache index keys them (`Legs.indexed_ids`), else a length and no ids: the ids'
        count (capped by a `truncate_prompt_tokens` above 0), or a string's characters / 4 + 1.
        """
        ids = legs.indexed_ids
        if ids is not None:
            cached = None
            if self.cache is not None:
                urls = [w.url for pool in (Pool.PREFILL, Pool.DECODE)
                        for w in self.registry.routable(pool)]
                cached = self.cache.predict(ids, urls)
            return RouteRequest.of_ids(ids, self.kv_bytes_per_token, cached)
        if isinstance(legs.prompt, list):
            guess = len(legs.prompt)
            keep = legs.tokenwise.get("truncate_prompt_tokens")
            if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0:
                guess = min(guess, keep)
        else:
            guess = len(legs.prompt) // 4 + 1
        return RouteRequest(guess, None, guess * self.kv_bytes_per_token)

    def _note_unsynced(self, pool: Pool, candidates: list[Worker], request: RouteRequest
                       ) -> None:
        """Count a pick that scored some candidate by load alone (its view not synced)."""
        if self.cache is not None and request.token_ids is not None and any(
                request.cached is None or w.url not in request.cached for w in candidates):
            self.metrics.kv_unsynced_picks.labels(pool.value).inc()

    def plan(self, legs: Legs) -> Plan:
        """The request as the policies see it and its D (see `Plan`); NoWorker or Overloaded
        when no D can take it. A request of one token needs no D: it is P's alone, sparing D's
        decodes, as the simulator routes it."""
        request = self.route_request(legs)
        if legs.max_tokens == 1:
            return Plan(request, None)
        decode = self.registry.routable(Pool.DECODE)
        self._note_unsynced(Pool.DECODE, decode, request)
        d = self.picker.decode(decode, request)
        plan = Plan(request, d, request.cached_on(d.url))
        n = self.cfg.local_prefill_max_tokens
        if self.cache is not None and plan.d_cached:
            reused = self.cache.reusable(d.url, plan.d_cached, request.prompt_len)
            if prefill_on_d(reused, request.prompt_len, n):
                plan.local, plan.local_reused = True, reused
        return plan

    def count_local(self, plan: Plan) -> None:
        """A request run whole on its D (prefill on D), in the metrics."""
        assert plan.local and plan.decode is not None
        url = plan.decode.url
        self.metrics.local_prefills.labels(url).inc()
        self.metrics.local_prefill_tokens.labels(url).inc(
            plan.request.prompt_len - plan.local_reused)
        self.metrics.cached_predicted.labels(Pool.DECODE.value, url).inc(plan.local_reused)

    def local(self, plan: Plan) -> Prefilled:
        """Prefill on D: the request as a decode leg on `plan.decode` from its prompt alone (no
        P leg, no t1, no transfer), so that a broken stream resumes on another D exactly as a
        split one does. Takes the leg's reservation on D, as `prefill` does."""
        assert plan.local and plan.decode is not None and plan.request.token_ids is not None
        plan.decode.acquire()
        return Prefilled(prompt_ids=list(plan.request.token_ids), t1_text="", t1_ids=[],
                         finish_reason=None, stop_reason=None, fingerprint=None,
                         decode=plan.decode, transfer=None)

    def _p_reused(self, p: Worker, request: RouteRequest) -> int:
        """The prompt tokens P's engine is predicted to reuse from its cache."""
        if self.cache is None:
            return 0
        return self.cache.reusable(p.url, request.cached_on(p.url), request.prompt_len)

    def _engine_cached(self, pool: Pool, url: str, predicted: int,
                       usage: dict[str, Any] | None) -> None:
        """The engine's count of cached prompt tokens in a leg's `usage` (when the worker reports
        one: `--enable-prompt-tokens-details`) against the prediction for that same leg."""
        details = (usage or {}).get("prompt_tokens_details")
        told = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(told, int) and not isinstance(told, bool):
            self.metrics.cached_reported.labels(pool.value, url).inc(told)
            self.metrics.cached_predicted_reported.labels(pool.value, url).inc(predicted)

    async def prefill(self, legs: Legs, rid: str, t: Timings, plan: Plan | None = None
                      ) -> Prefilled:
        plan = plan if plan is not None else self.plan(legs)
        request = plan.request
        retry = Retry(self.cfg, self.metrics, self.registry, "prefill",
                      self.cfg.prefill_retries, t, rid)
        for attempt in retry:
            await retry.begin(attempt)
            routable = self.registry.routable(Pool.PREFILL)
            pool = [w for w in routable if w.url not in retry.tried] or routable
            self._note_unsynced(Pool.PREFILL, pool, request)
            p = self.picker.prefill(pool, request)
            # A request known to end at t1 (one token) never involves D: no pick, no KV.
            d = None if legs.max_tokens == 1 else (
                plan.decode if attempt == 0 and plan.decode is not None and plan.decode.routable
                else self.picker.decode(self.registry.routable(Pool.DECODE), request))
            # Named after the request (logs join up; test faults are chosen per request id),
            # fresh per attempt.
            tid = f"{rid}-{uuid.uuid4().hex[:16]}"
            d_cached = request.cached_on(d.url) if d is not None else 0
            tr = None
            if d is not None and (proto := self.protocols.for_pair(p, d)) is not None:
                tr = proto.open(p, d, tid, d_cached=d_cached)
            body = prefill_body(legs, self.model, None if tr is None else tr.prefill_params)
            early = (EarlyDecode.send(self.session, tr, legs, self.model,
                                      f"{rid}-p{attempt}d", encode)
                     if tr is not None and tr.via.concurrent else None)
            t.prefill_url, t.decode_url = p.url, d.url if d is not None else None
            t.transfer_id, t.transfer = (tid, tr) if tr else (None, None)
            p_reused = self._p_reused(p, request)
            prompt_len = request.prompt_len - p_reused  # what P still computes
            t.cached = {"p_cached": p_reused, "d_cached": d_cached}
            t.p_sent, t.p_sent_wall = time.monotonic(), time.time()
            p.acquire(prompt_len)
            if d is not None:  # reserved now, so a burst spreads over D before any leg starts
                d.acquire()
            reserved = False
            try:
                out = await self._prefill_leg(p, body, f"{rid}-p{attempt}")
                reserved = True
            except (*TRANSPORT_ERRORS, LegFailed) as exc:
                retry.failed(p, exc)
                abandon(tr, early)  # whatever P sent for this attempt will never be claimed
                continue
            except BaseException:  # P refused it, or the client left: D's early leg goes too
                abandon(tr, early)
                raise
            finally:
                p.release(prompt_len)
                if not reserved and d is not None:
                    d.release()
            self.registry.succeeded(p)
            self.metrics.cached_predicted.labels(Pool.PREFILL.value, p.url).inc(p_reused)
            self._engine_cached(Pool.PREFILL, p.url, p_reused, out.usage)
            t.t1_back = time.monotonic()
            # P always stops at "length" (max_tokens 1); the request itself ends at t1 only on a
            # stop token, a budget of one token, or a full context.
            reason = out.finish_reason
            done = d is None or reason == "stop" or (
                reason == "length" and self.max_model_len is not None
                and len(out.prompt_ids) + 1 >= self.max_model_len)
            if tr is not None:
                tr.via.received(tr, out.body)
            if done:
                if d is not None:
                    d.release()
                abandon(tr, early)  # KV was sent for a decode leg that will never come
            return Prefilled(
                prompt_ids=out.prompt_ids, t1_text=out.text, t1_ids=out.token_ids,
                finish_reason=reason if done else None,
                stop_reason=out.stop_reason if done else None,
                fingerprint=out.fingerprint, decode=None if done else d,
                transfer=None if done else tr, reserved=not done,
                early=None if done else early)
        raise exhausted(retry.last, "prefill", "prefill")

    async def _prefill_leg(self, p: Worker, body: dict[str, Any], request_id: str
                           ) -> PrefillAnswer:
        """P's answer (HTTP 200); LegFailed on a status worth a retry or an answer out of
        shape, UpstreamError on any other status. Read to the end inside the block: the
        connection goes back to the pool."""
        async with self.session.post(
                f"{p.url}/v1/completions", data=encode(body),
                headers={**JSON_HEADERS, "X-Request-Id": request_id}) as r:
            raw = await r.read()
        if r.status in RETRYABLE_STATUS:
            raise LegFailed(f"http_{r.status}", raw[:200].decode(errors="replace"), r.status)
        if r.status != 200:
            raise UpstreamError(r.status, upstream_body(r.status, raw))
        return PrefillAnswer.parse(raw)

    # --- D ----------------------------------------------------------------------------------
    def _resume_on(self, tried: set[str]) -> Worker:
        """Where a failed decode leg resumes: a D not tried yet, else a colocated worker not
        tried yet, else any D in rotation, else any colocated worker. Each of them recomputes
        from the prompt and the tokens produced so far, so any of them is exact."""
        decode = self.registry.routable(Pool.DECODE)
        colocated = self.registry.routable(Pool.COLOCATED)
        groups = ((self.picker.decode, [w for w in decode if w.url not in tried]),
                  (self.picker.colocated, [w for w in colocated if w.url not in tried]),
                  (self.picker.decode, decode), (self.picker.colocated, colocated))
        refused: NoWorker = NoWorker("decode or colocated")
        for pick, pool in groups:
            if pool:
                try:
                    return pick(pool)
                except NoWorker as exc:  # every worker of the group at its queue limit
                    refused = exc
        raise refused

    async def decode(self, legs: Legs, rid: str, pre: Prefilled, joiner: Joiner, t: Timings
                     ) -> AsyncIterator[dict[str, Any]]:
        """Yield the client's token chunks from D (t1 already went through `joiner`).

        Invariant: whenever this generator stops early (cancelled, closed, or a leg failed),
        the open leg's connection is closed, not returned to the pool, and closing it aborts the
        request in vLLM; the leg's hold on its worker is released exactly once; and the
        transfer made at prefill is released (idempotent), since no later leg loads it."""
        assert pre.decode is not None and pre.reserved
        d, tr = pre.decode, pre.transfer
        pre.reserved = False  # the first attempt's leg is the reservation taken at prefill
        retry = Retry(self.cfg, self.metrics, self.registry, "decode",
                      self.cfg.decode_retries, t, rid)
        for attempt in retry:
            await retry.begin(attempt)
            if attempt:
                d = self._resume_on(retry.tried)
                tr = None  # resumption recomputes: never read KV staged for another worker
                d.acquire()
            t.decode_url = d.url
            start = DecodeStart(None) if tr is None else tr.via.decode_start(tr, joiner.produced)
            early = pre.early if attempt == 0 else None  # sent with P's leg: take it over
            t.d_sent, t.d_first = early.sent if early else time.monotonic(), None
            # the leg D's KV record describes: the first one (a resumed leg loads no KV)
            t.d_sent_wall = time.time() - (time.monotonic() - t.d_sent) if tr else None
            r: aiohttp.ClientResponse | None = None
            complete = False  # read to the end: the connection may be reused
            try:
                if early is not None:
                    r = await early.response()
                else:
                    body = decode_body(legs, self.model, pre.prompt_ids, joiner.produced,
                                       start.kv_transfer_params, start.replayed)
                    r = await self.session.post(
                        f"{d.url}/v1/completions", data=encode(body),
                        headers={**JSON_HEADERS, "X-Request-Id": f"{rid}-d{attempt}"})
                if r.status in RETRYABLE_STATUS:
                    raise LegFailed(f"http_{r.status}",
                                    (await r.read())[:200].decode(errors="replace"), r.status)
                if r.status != 200:
                    raise UpstreamError(r.status, upstream_body(r.status, await r.read()))
                async for chunk in relay(r, joiner, t, start.replayed,
                                         self._record_on_first(t, tr)):
                    yield chunk
                complete = True
                if joiner.finish_reason is None:
                    raise LegFailed("stream_cut", "D's stream ended before a finish reason")
                self.registry.succeeded(d)
                if attempt == 0 and t.mode == "local":  # D loaded no KV: its count is its cache's
                    self._engine_cached(Pool.DECODE, d.url, (t.cached or {}).get("d_cached", 0),
                                        t.d_usage)
                return
            except (*TRANSPORT_ERRORS, LegFailed) as exc:
                abandon(tr, None)  # a later leg recomputes: none will load the staged KV
                if joiner.finish_reason is not None:
                    # the leg broke after its last token (on its usage chunk or `[DONE]`):
                    # the answer is whole, and a new leg would add tokens past its end
                    return
                retry.failed(d, exc)
                if attempt == retry.limit:
                    raise UpstreamError(502, {"error": {
                        "message": f"decode failed on every attempt: {exc}",
                        "type": "UpstreamError", "param": None, "code": 502}}) from exc
            except BaseException:  # D refused the leg, or the client left
                abandon(tr, None)
                raise
            finally:
                if r is not None:
                    if complete:
                        r.release()
                    else:
                        r.close()  # mid-stream: aborts the request in vLLM
                d.release()

    def release(self, pre: Prefilled | None) -> None:
        """Drop an unused D reservation (the request ended or the client left before D), and
        release the transfer made for it."""
        if pre is not None and pre.reserved and pre.decode is not None:
            pre.reserved = False
            pre.decode.release()
            abandon(pre.transfer, pre.early)

    def _record_on_first(self, t: Timings, tr: Transfer | None) -> Callable[[], None]:
        """At D's first token: fetch the transfer's record while D streams (once)."""
        def fetch() -> None:
            if tr is not None and t.record_fetch is None:
                t.record_fetch = asyncio.get_running_loop().create_task(
                    self._fetch_record(t, tr, tr.decode.url))
        return fetch

    async def transfer_record(self, t: Timings, timeout_s: float = 0.5) -> None:
        """The connector's record of the transfer into `t.kv` (best effort: timings only). Uses
        the one fetched while D streamed when that one is final, else asks D now."""
        tr = t.transfer
        if tr is None or not t.transfer_id or not t.decode_url:
            return
        if t.record_fetch is not None:
            await t.record_fetch  # never raises: `record` logs and swallows
            if t.kv is not None and tr.via.record_final(t.kv):
                return
        await self._fetch_record(t, tr, t.decode_url, timeout_s)

    async def _fetch_record(self, t: Timings, tr: Transfer, at_url: str,
                            timeout_s: float = 0.5) -> None:
        record = await tr.via.record(tr, at_url, timeout_s)
        if record is not None:
            t.kv = record
