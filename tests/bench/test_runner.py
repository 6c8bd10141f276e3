"""`run_once`'s accounting against a scripted OpenAI endpoint that counts like splitserve's
router: the counters of a run cover its measured requests, never its warm-up, and the run goes
over the warm-up's connections."""

from __future__ import annotations

import json

from aiohttp import web

from splitserve.bench.client import ClientConfig
from splitserve.bench.runner import RunOptions, run_once
from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec


async def test_the_warm_up_is_sent_before_the_counters_are_read() -> None:
    served: list[int] = []  # max_tokens of each completion, in arrival order
    peers: list[int] = []  # the client's port of each completion's connection

    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        served.append(body["max_tokens"])
        assert req.transport is not None
        peers.append(req.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for t in range(body["max_tokens"]):
            chunk = {"choices": [{"text": "x", "token_ids": [t]}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_: web.Request) -> web.Response:
        n = len(served)  # one transfer of 100 bytes per request, as the router counts them
        return web.Response(text="# TYPE splitserve_router_kv_bytes histogram\n"
                                 f'splitserve_router_kv_bytes_bucket{{le="+Inf"}} {n}\n'
                                 f"splitserve_router_kv_bytes_count {n}\n"
                                 f"splitserve_router_kv_bytes_sum {100 * n}\n")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        spec = WorkloadSpec(num_requests=3, input=LengthDist("fixed", 16),
                            output=LengthDist("fixed", 4), arrival=ArrivalSpec("poisson", 50.0),
                            warmup=2)
        result = await run_once(ClientConfig(url), spec, "s", {}, {}, RunOptions())
    finally:
        await runner.cleanup()
    assert served == [8, 8, 4, 4, 4]  # the two warm-up requests first (8 tokens each)
    assert peers[2] in peers[:2]  # the first measured request opened no connection
    assert result["completed"] == 3
    assert (result["kv_transfers"], result["kv_bytes_moved"]) == (3, 300)
