"""`splitserve demo`: the main job, on the embedded model, with nothing to download.

1. A tour of one request: a 1P+1D deployment (launcher + router), one streamed completion, and
   what happened on each leg — t1 at once from P and the continuation from D (text and token
   ids), the KV transfer's size, exposed tail and wire rate, and the handover.
2. The benchmark: the interference workload on a colocated worker without prefill chunking, one
   with chunked prefill, and 1P+1D, side by side (`splitserve.bench.demo.run_demo`), writing
   `demo-results/*.json` and `demo-results/report.html`.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from splitserve.launch.config import DeploymentConfig
from splitserve.launch.local import LocalDeployment
from splitserve.worker.launch import free_port

PROMPT = ("Disaggregated serving runs the prompt on one worker and the answer on another. " * 40)


def stream_one(url: str, prompt: str, max_tokens: int = 32) -> dict[str, object]:
    """Stream one completion; return chunk texts, their token ids, their arrival times and the
    router's timings."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    texts: list[str] = []
    ids: list[list[int]] = []
    times: list[float] = []
    timings: dict[str, object] = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        request_id = r.headers.get("x-request-id", "")
        for line in r.iter_lines():
            if line.startswith(": splitserve-timings "):
                timings = json.loads(line.split(" ", 2)[2])
            elif line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    texts.append(choice.get("text", ""))
                    ids.append(list(choice.get("token_ids") or []))
                    times.append(time.perf_counter() - t0)
    return {"texts": texts, "ids": ids, "times": times, "timings": timings,
            "request_id": request_id}


def kv_line(t: dict[str, object]) -> str | None:
    """The KV transfer as a user needs it: bytes; the exposed tail (end of P's last layer to D's
    ACK: what overlapping the push with the prefill leaves); the wire rate over the bytes in
    flight; BEGIN -> END (which spans P's prefill) apart. None when no KV moved."""
    nbytes = t.get("kv_bytes")
    if not isinstance(nbytes, int | float) or not nbytes:
        return None

    def ms(key: str) -> str:
        v = t.get(key)
        return f"{v * 1e3:.1f} ms" if isinstance(v, int | float) else "n/a"

    gbps = t.get("kv_gbps")
    rate = f"{gbps:.2f} GB/s" if isinstance(gbps, int | float) else "n/a"
    return (f"KV transfer {t.get('transfer_id')}: {int(nbytes) / 1e6:.1f} MB; exposed tail "
            f"(end of P's last layer -> D's ACK) {ms('kv_tail_s')}; wire rate {rate} "
            f"({ms('kv_wire_s')} of bytes in flight); BEGIN -> END {ms('kv_transfer_s')} "
            f"(spans P's prefill); loaded into D's blocks in {ms('kv_load_s')}; status "
            f"{t.get('kv_status')}")


def tour(transport: str) -> None:
    cfg = DeploymentConfig(prefill=1, decode=1, transport=transport, port=free_port())
    print(f"== one request through 1P+1D ({transport}) on the embedded model ==")
    with LocalDeployment(cfg) as dep:  # entering starts every part and waits until healthy
        url = dep.url
        # warm-up on another prompt: first requests pay one-off costs, and the same prompt would
        # be served from both workers' prefix caches
        stream_one(url, "A short warm-up request.", 4)
        res = stream_one(url, PROMPT)
    texts, ids, times = res["texts"], res["ids"], res["times"]
    t = res["timings"]
    assert isinstance(texts, list) and isinstance(ids, list) and isinstance(times, list)
    assert isinstance(t, dict)
    print(f"request {res['request_id']}: {len(PROMPT.split())} words of prompt")
    print("(the embedded model's weights are random, so its text means nothing; the token ids "
          "are what P and D computed)")
    print(f"t1 (from the prefill worker, {times[0] * 1e3:.0f} ms after sending): {texts[0]!r} "
          f"token ids {ids[0]}")
    print(f"continuation (from the decode worker): {''.join(texts[1:])!r} "
          f"token ids {[i for piece in ids[1:] for i in piece]}")
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if gaps:
        print(f"inter-token gaps: median {sorted(gaps)[len(gaps) // 2] * 1e3:.1f} ms, "
              f"max {max(gaps) * 1e3:.1f} ms")

    def ms(key: str) -> str:
        v = t.get(key)
        return f"{v * 1e3:.1f} ms" if isinstance(v, int | float) else "n/a"

    print(f"prefill leg {ms('p_leg_s')}, TTFT at the router {ms('ttft_s')}, "
          f"handover t1->t2 {ms('handover_s')}, decode queue {ms('d_queue_s')} "
          f"(D leg -> D's step {ms('d_wait_s')})")
    if (line := kv_line(t)) is not None:
        print(line)


def run(args: argparse.Namespace) -> int:
    if not args.skip_tour:
        tour(args.transport)
    if args.tour_only:
        return 0
    from splitserve.bench.demo import run_demo

    print("\n== the interference workload: colocated vs chunked vs 1P+1D ==")
    results = run_demo(args.out)
    return 0 if results else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: one request's tour, then the A/B benchmark")
    p.add_argument("--out", default="demo-results")
    p.add_argument("--transport", choices=("tcp", "shm"), default="shm")
    p.add_argument("--skip-tour", action="store_true", help="only the benchmark")
    p.add_argument("--tour-only", action="store_true", help="only the one-request tour")
    p.set_defaults(func=run)
