"""Stream parsing: token counts per chunk, usage, errors, the server's per-leg timings; the busy
sampler."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from splitserve.bench.client import (
    BusySampler,
    RequestRecord,
    _absorb_chunk,
    _absorb_comment,
    parse_busy,
    parse_load,
    parse_sum,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def record() -> RequestRecord:
    return RequestRecord(index=0, kind="normal", input_len=5, requested_output_len=4,
                         scheduled_s=0.0)


def test_chunks_count_token_ids_and_skip_usage_only_chunks() -> None:
    r = record()
    _absorb_chunk(r, {"choices": [{"text": "ab", "token_ids": [5, 6]}]}, 0.1)
    _absorb_chunk(r, {"choices": [{"text": "c"}]}, 0.2)  # no token ids: one token
    _absorb_chunk(r, {"choices": [], "usage": {"completion_tokens": 4}}, 0.3)
    assert r.chunk_times == [0.1, 0.2] and r.chunk_tokens == [2, 1]
    assert r.usage_output_tokens == 4 and r.ok


def test_error_event_fails_the_request() -> None:
    r = record()
    _absorb_chunk(r, {"error": {"message": "worker died", "code": 502}}, 0.1)
    assert not r.ok and r.error_cause == "stream_error" and "worker died" in (r.error or "")


def test_server_timings_from_comment_and_field() -> None:
    r = record()
    _absorb_comment(r, ': splitserve-timings {"kv_transfer_s":0.012,"mode":"split"}')
    _absorb_comment(r, ": keep-alive")
    _absorb_chunk(r, {"choices": [], "splitserve": {"p_leg_s": 0.3}}, 0.1)
    assert r.server_timings == {"kv_transfer_s": 0.012, "mode": "split", "p_leg_s": 0.3}


def test_parse_busy() -> None:
    idle = 'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0'
    assert not parse_busy(idle)
    assert parse_busy(idle.replace("waiting{engine=\"0\"} 0.0", "waiting{engine=\"0\"} 2.0"))
    assert parse_busy('vllm:num_requests_running{engine="0"} 1.0')
    two = 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
    assert parse_load(two + 'vllm:num_requests_waiting{engine="0"} 4.0') == (3.0, 4.0)


def test_parse_sum_over_label_sets() -> None:
    text = ('vllm:request_prefill_time_seconds_sum{engine="0"} 1.5\n'
            'vllm:request_prefill_time_seconds_sum{engine="1"} 0.5\n'
            'vllm:request_prefill_time_seconds_count{engine="0"} 3.0\n')
    assert parse_sum(text, "vllm:request_prefill_time_seconds_sum") == 2.0
    assert parse_sum(text, "vllm:request_decode_time_seconds_sum") is None


def _sse(*events: str) -> bytes:
    return "".join(f"{e}\n\n" for e in events).encode()


async def _send(body: bytes, status: int = 200, headers: dict[str, str] | None = None
                ) -> RequestRecord:
    import httpx

    from splitserve.bench.client import ClientConfig, send_one
    from splitserve.bench.workload import Request

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["prompt"] == [11, 12, 13] and sent["max_tokens"] == 3 and sent["stream"]
        assert request.headers["x-request-id"] == "t-7"
        return httpx.Response(status, content=body, headers=headers or {})

    req = Request(index=7, arrival_s=0.0, prompt_token_ids=(11, 12, 13), output_len=3)
    rec = RequestRecord(index=7, kind="normal", input_len=3, requested_output_len=3,
                        scheduled_s=0.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await send_one(client, ClientConfig("http://server", run_tag="t"), "m", req, rec, 0.0)
    return rec


def _chunk(ids: list[int]) -> str:
    return "data: " + json.dumps({"choices": [{"text": "x", "token_ids": ids}]})


async def test_send_one_records_a_whole_stream() -> None:
    rec = await _send(_sse(_chunk([1]), _chunk([2, 3]), ': splitserve-timings {"p_leg_s":0.2}',
                           "data: [DONE]"),
                      headers={"x-request-id": "t-7", "x-splitserve-timings": '{"mode":"x"}'})
    assert rec.ok and rec.status == 200 and rec.request_id == "t-7"
    assert rec.chunk_tokens == [1, 2] and len(rec.chunk_times) == 2
    assert rec.server_timings == {"mode": "x", "p_leg_s": 0.2}
    assert rec.end_s >= rec.chunk_times[-1] >= rec.send_s


async def test_send_one_failures_are_explicit() -> None:
    truncated = await _send(_sse(_chunk([1])))
    assert truncated.error_cause == "truncated" and truncated.chunk_tokens == [1]
    busy = await _send(b'{"error": "overloaded"}', status=503)
    assert busy.error_cause == "http_503" and "overloaded" in (busy.error or "")
    assert busy.end_s >= busy.send_s > 0  # a refused request spans [send, its answer's end]
    # a stream that vLLM ends unfinished is no success, whatever follows it
    aborted = await _send(_sse(_chunk([1]), 'data: {"choices": [{"text": "", "finish_reason": '
                                            '"abort"}]}', "data: [DONE]"))
    assert aborted.error_cause == "aborted" and aborted.chunk_tokens == [1]
    empty = await _send(_sse("data: [DONE]"))
    assert empty.error_cause == "empty"


@asynccontextmanager
async def metrics_servers(handlers: dict[str, Handler]) -> AsyncIterator[dict[str, str]]:
    """One loopback server per name, answering /metrics with its handler: name -> URL."""
    urls, runners = {}, []
    try:
        for name, handler in handlers.items():
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_busy_sampler_counts_no_sample_from_a_refusing_worker() -> None:
    """A worker that refuses the sampler (401: no deployment token) is unknown, never idle."""
    busy = 'vllm:num_requests_running{engine="0"} 1.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'

    async def refuse(_: web.Request) -> web.Response:
        return web.Response(status=401, text="no token")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=busy)

    async with metrics_servers({"refusing": refuse, "busy": metrics}) as urls:
        sampler = BusySampler(urls, interval_s=0.01)
        sampler.start()
        await asyncio.sleep(0.2)
        out = await sampler.stop()
    assert math.isnan(out["refusing"]) and out["busy"] == 1.0


async def sampled_run(pages: dict[str, str], d_at_stop: str) -> BusySampler:
    """A sampler over one loopback /metrics server a name, each answering `pages[name]`; D's page
    becomes `d_at_stop` during the run. Returns the stopped sampler."""

    def serve(name: str):  # type: ignore[no-untyped-def]
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=pages[name])
        return metrics

    async with metrics_servers({name: serve(name) for name in pages}) as urls:
        sampler = BusySampler(urls, interval_s=0.01)
        sampler.start()
        await asyncio.sleep(0.2)
        pages["d"] = d_at_stop
        await sampler.stop()
    return sampler


async def test_busy_sampler_reports_nixl_transfers_over_the_run() -> None:
    """vLLM's `vllm:nixl_*` histograms, read at the start and at the stop: the run's transfers
    per worker that pulled over NIXL; a worker without them has no entry."""

    def page(count: float, xfer_s: float, post_s: float, nbytes: float) -> str:
        return (f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {count}\n'
                f'vllm:nixl_xfer_time_seconds_sum{{engine="0"}} {xfer_s}\n'
                f'vllm:nixl_post_time_seconds_sum{{engine="0"}} {post_s}\n'
                f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {nbytes}\n'
                'vllm:num_requests_running{engine="0"} 0.0\n')

    pages = {"d": page(2, 0.010, 0.002, 2e6), "p": 'vllm:num_requests_running{engine="0"} 0.0\n'}
    sampler = await sampled_run(pages, page(5, 0.040, 0.005, 5e6))
    out = sampler.nixl_transfers()
    assert set(out) == {"d"}
    assert out["d"]["transfers"] == 3
    assert math.isclose(out["d"]["mean_xfer_ms"], 10.0)
    assert math.isclose(out["d"]["mean_post_ms"], 1.0)
    assert math.isclose(out["d"]["mean_bytes"], 1e6)


async def test_busy_sampler_reports_drafting_over_the_run() -> None:
    """vLLM's `vllm:spec_decode_*` counters, read at the start and at the stop: per worker that
    drafted in the run, its drafts, draft and accepted tokens and their rates."""

    def page(drafts: float, proposed: float, accepted: float) -> str:
        return (f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}\n'
                f'vllm:spec_decode_num_drafts_created{{engine="0"}} 1.7e9\n'
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {proposed}\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}\n'
                'vllm:num_requests_running{engine="0"} 0.0\n')

    pages = {"d": page(10, 30, 12), "idle": page(4, 12, 1),
             "p": 'vllm:num_requests_running{engine="0"} 0.0\n'}
    out = (await sampled_run(pages, page(30, 90, 57))).spec_decode()
    assert set(out) == {"d"}  # "idle" drafted nothing in the run, P has no counters
    assert out["d"] == {"drafts": 20, "draft_tokens": 60, "accepted_tokens": 45,
                        "acceptance_rate": 0.75, "accepted_per_draft": 2.25}
