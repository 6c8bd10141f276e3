"""A router's capacity on one core: streamed tokens per second at 1,000 concurrent streams, and
the latency tail it adds on the way.

A real engine on this machine streams a few thousand tokens a second, far below what a router
relays, so the upstream here is `_stream_upstream.py`: a stand-in for a plain vLLM worker whose
step loop gives every open stream a token per step and waits for a reader that is behind. Each
router (splitserve's, vllm-router when installed, and the bare relay, `_bare_relay.py`, the floor
of splitserve's stack) runs on core 0 in front of it; the upstream and this client share the
other core. `direct` (the client on the upstream itself) is the harness's own ceiling: a router
figure near it is bounded by the harness, not by the router.

Levels, each with `--streams` streams opened evenly over `--ramp-s` (5 s: 200 new requests a
second at 1,000 streams):
- paced, one per `--itl-ms` value: one step every ITL ms, so 1,000 streams at 50 ms offer
  20,000 tokens/s, one chunk per token as an engine emits them. Each stream lives about
  `--stream-s` seconds. Figures: tokens/s delivered, the gap between a stream's token reads
  (p50, p99, p99.9), TTFT (p50, p99), and how busy the router's core was. A router's capacity
  is the highest paced level it relays with its gap p99 within twice the ITL.
- saturated (streams opened over 1 s): no pause between steps; each stream gets a token
  whenever its reader has taken the last, so tokens queue and a byte relay forwards them in
  larger reads. The harness's core is then the bound (its CPU is printed): this level shows how
  a router behaves overloaded, not its capacity.

Throughput, CPU and gaps are taken over the window when every stream is open (the last first
token to the first stream's end). Targets run interleaved, `--rounds` times; medians over rounds.
Printed and written to JSON, never asserted.

    python benchmarks/router_capacity.py [--streams 1000] [--itl-ms 100,50,33,25]
        [--vllm-router-path DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).parent))

from _common import cpu_seconds, spawn, stop, summary, write_json  # noqa: E402
from router_overhead import (  # noqa: E402
    tiny_model,
    vllm_router_env,
    vllm_router_installed,
    wait_started,
)

from splitserve.worker.launch import free_port, wait_healthy  # noqa: E402

DATA = b"data: {"
DONE = b"data: [DONE]"


@dataclass
class StreamReader(asyncio.Protocol):
    """One streaming completion over its own connection: when each read carrying tokens came,
    and how many tokens it carried."""

    request: bytes
    done: asyncio.Future[bool]
    opened: float = 0.0
    reads: list[tuple[float, int]] = field(default_factory=list)
    tail: bytes = b""
    head: bytes = b""
    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.head:
            self.head = data[:12]
        joined = self.tail + data
        n = joined.count(DATA)
        if n:
            self.reads.append((now, n))
        self.tail = joined[-(len(DONE) - 1):]  # a pattern cut between two reads
        if DONE in joined and self.transport is not None:
            self.transport.close()
            if not self.done.done():
                self.done.set_result(self.head.startswith(b"HTTP/1.1 200"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(False)


def completion_request(port: int, tokens: int) -> bytes:
    body = json.dumps({"model": "bench", "prompt": [30, 31, 32], "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (port, len(body), body))


async def phase(port: int, streams: int, tokens: int, ramp_s: float, pids: dict[str, int]
                ) -> dict[str, Any]:
    """`streams` streams of `tokens` tokens each against 127.0.0.1:`port`; CPU of `pids`
    sampled throughout."""
    loop = asyncio.get_running_loop()
    request = completion_request(port, tokens)
    readers: list[StreamReader] = []
    samples: list[tuple[float, dict[str, float]]] = []

    async def sample() -> None:
        while True:
            samples.append((time.perf_counter(),
                            {k: cpu_seconds(p) for k, p in pids.items()}))
            await asyncio.sleep(0.05)

    async def open_one(i: int, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + i * ramp_s / streams - loop.time()))
        r = StreamReader(request, loop.create_future())
        readers.append(r)
        r.opened = time.perf_counter()
        try:
            await loop.create_connection(lambda: r, "127.0.0.1", port)
        except OSError:
            r.done.set_result(False)

    sampler = asyncio.create_task(sample())
    t0 = loop.time()
    await asyncio.gather(*(open_one(i, t0) for i in range(streams)))
    ok = await asyncio.wait_for(asyncio.gather(*(r.done for r in readers)), 600)
    sampler.cancel()
    samples.append((time.perf_counter(), {k: cpu_seconds(p) for k, p in pids.items()}))
    return measure(readers, ok, samples)


def measure(readers: list[StreamReader], ok: list[bool],
            samples: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    good = [r for r, k in zip(readers, ok, strict=True) if k and r.reads]
    if not good:
        return {"streams_ok": 0, "streams_failed": len(readers), "window_s": 0.0,
                "tokens_per_s": 0.0, "gap_ms": {}, "ttft_ms": {}, "cpu_busy": {},
                "tokens_per_router_cpu_s": float("nan")}
    start = max(r.reads[0][0] for r in good)
    end = min(r.reads[-1][0] for r in good)
    if end <= start:  # streams too short to overlap: the whole run is the window
        start, end = min(r.reads[0][0] for r in good), max(r.reads[-1][0] for r in good)
    tokens = sum(n for r in good for t, n in r.reads if start <= t <= end)
    gaps = [b[0] - a[0] for r in good for a, b in zip(r.reads, r.reads[1:], strict=False)
            if start <= a[0] and b[0] <= end]
    ttft = sorted(r.reads[0][0] - r.opened for r in good)
    inside = [s for s in samples if start <= s[0] <= end] or samples
    cpu = {k: inside[-1][1][k] - inside[0][1][k] for k in inside[0][1]}
    span = inside[-1][0] - inside[0][0]
    return {"streams_ok": len(good), "streams_failed": len(readers) - len(good),
            "window_s": end - start, "tokens_per_s": tokens / (end - start),
            "gap_ms": summary(gaps), "ttft_ms": summary(ttft),
            "cpu_busy": {k: v / span for k, v in cpu.items()} if span > 0 else {},
            "tokens_per_router_cpu_s": (tokens / (end - start)) / (cpu["router"] / span)
            if "router" in cpu and cpu["router"] > 0 and span > 0 else float("nan")}


def set_itl(upstream: str, ms: float) -> None:
    httpx.post(f"{upstream}/bench/itl", json={"ms": ms}, timeout=10).raise_for_status()


def run(args: argparse.Namespace, logs: Path) -> tuple[dict[str, Any], str]:
    cores = sorted(os.sched_getaffinity(0))
    router_core, harness_core = (cores[0],), tuple(cores[1:] or cores)
    os.sched_setaffinity(0, harness_core)
    model_dir = args.model or tiny_model()
    up_port = free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    procs = [spawn([sys.executable, str(Path(__file__).parent / "_stream_upstream.py"),
                    "--port", str(up_port), "--model-root", model_dir],
                   logs / "upstream.log", harness_core)]
    try:
        wait_healthy(upstream_url, procs[0], 60)
        urls, started = {"direct": upstream_url}, {}
        ours = free_port()
        procs.append(spawn([sys.executable, "-m", "splitserve.cli", "router", "--colocated",
                            upstream_url, "--port", str(ours), "--log-level", "warning",
                            "--max-inflight-per-worker", str(4 * args.streams)],
                           logs / "splitserve-router.log", router_core))
        urls["splitserve"], started["splitserve"] = f"http://127.0.0.1:{ours}", procs[-1]
        rust_note = "not installed (pip install vllm-router, or --vllm-router-path)"
        if vllm_router_installed(args, logs):
            rust = free_port()
            procs.append(spawn([sys.executable, "-m", "vllm_router.launch_router",
                                "--worker-urls", upstream_url, "--policy", "round_robin",
                                "--port", str(rust), "--host", "127.0.0.1",
                                "--prometheus-port", str(free_port()),
                                "--log-level", "warning"],
                               logs / "vllm-router.log", router_core, vllm_router_env(args)))
            urls["vllm-router"], started["vllm-router"] = f"http://127.0.0.1:{rust}", procs[-1]
            rust_note = "installed"
        bare = free_port()
        procs.append(spawn([sys.executable, str(Path(__file__).parent / "_bare_relay.py"),
                            "--upstream", upstream_url, "--port", str(bare)],
                           logs / "bare-relay.log", router_core))
        urls["bare-relay"], started["bare-relay"] = f"http://127.0.0.1:{bare}", procs[-1]
        pids = wait_started(urls, started, logs)
        levels = {f"paced {itl:g} ms": (itl, max(2, round(args.stream_s * 1e3 / itl)),
                                        args.ramp_s) for itl in args.itl_ms}
        levels["saturated"] = (0.0, args.saturated_tokens, 1.0)
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            lv: {name: [] for name in urls} for lv in levels}
        for _ in range(args.rounds):
            for level, (itl, tokens, ramp_s) in levels.items():
                set_itl(upstream_url, itl)
                for name, url in urls.items():
                    watch = {"upstream": procs[0].pid, "client": os.getpid()}
                    if name in pids:
                        watch["router"] = pids[name]
                    port = int(url.rsplit(":", 1)[1])
                    runs[level][name].append(uvloop.run(
                        phase(port, args.streams, tokens, ramp_s, watch)))
    finally:
        for p in reversed(procs):
            stop(p)
    return runs, rust_note


def median_of(rs: list[dict[str, Any]], *path: str) -> float:
    vals = []
    for r in rs:
        v: Any = r
        for k in path:
            v = v.get(k, float("nan")) if isinstance(v, dict) else float("nan")
        vals.append(float(v))
    return statistics.median(vals)


def report(args: argparse.Namespace, runs: dict[str, Any], rust_note: str) -> None:
    result: dict[str, Any] = {"benchmark": "router_capacity", "streams": args.streams,
                              "ramp_s": args.ramp_s, "rounds": args.rounds,
                              "vllm_router": rust_note, "runs": runs, "medians": {},
                              "capacity_tokens_per_s": {}}
    print(f"{args.streams} streams opened over {args.ramp_s:g} s; medians of {args.rounds} "
          f"rounds; CPU: share of one core")
    print(f"{'level':>14} {'target':>12} {'tok/s':>7} {'gap p50':>8} {'p99':>7} {'p99.9':>7} "
          f"{'TTFT p50':>9} {'p99':>7} {'router CPU':>10} {'harness CPU':>11} {'failed':>6}")
    for level, by_target in runs.items():
        result["medians"][level] = {}
        for name, rs in by_target.items():
            m = {"tokens_per_s": median_of(rs, "tokens_per_s"),
                 "gap_ms": {q: median_of(rs, "gap_ms", f"{q}_ms")
                            for q in ("median", "p99", "p999")},
                 "ttft_ms": {q: median_of(rs, "ttft_ms", f"{q}_ms") for q in ("median", "p99")},
                 "router_cpu": median_of(rs, "cpu_busy", "router"),
                 "harness_cpu": median_of(rs, "cpu_busy", "upstream")
                 + median_of(rs, "cpu_busy", "client"),
                 "failed_streams": sum(r["streams_failed"] for r in rs)}
            result["medians"][level][name] = m
            print(f"{level:>14} {name:>12} {m['tokens_per_s']:>7.0f} "
                  f"{m['gap_ms']['median']:>8.1f} {m['gap_ms']['p99']:>7.1f} "
                  f"{m['gap_ms']['p999']:>7.1f} {m['ttft_ms']['median']:>9.1f} "
                  f"{m['ttft_ms']['p99']:>7.1f} {m['router_cpu']:>10.0%} "
                  f"{m['harness_cpu']:>11.0%} {m['failed_streams']:>6}")
    for name in runs[next(iter(runs))]:
        held = [result["medians"][f"paced {itl:g} ms"][name]["tokens_per_s"]
                for itl in args.itl_ms
                if result["medians"][f"paced {itl:g} ms"][name]["gap_ms"].get("p99", 1e9)
                <= 2 * itl]
        cap = max(held, default=0.0)
        result["capacity_tokens_per_s"][name] = cap
        print(f"capacity, {name}: {cap:,.0f} tokens/s (the highest paced level with gap p99 "
              f"<= 2 x ITL)" if held else f"capacity, {name}: below every paced level")
    write_json(Path(args.out), result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model directory for the routers' tokenizer "
                    "(default: the tiny llama of router_overhead.py)")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--itl-ms", type=lambda v: [float(x) for x in v.split(",")],
                    default=[100.0, 50.0, 33.0, 25.0],
                    help="paced levels: step periods, comma-separated")
    ap.add_argument("--stream-s", type=float, default=10.0,
                    help="paced: a stream's tokens, as seconds at its level's ITL")
    ap.add_argument("--saturated-tokens", type=int, default=500)
    ap.add_argument("--ramp-s", type=float, default=5.0, help="the streams open over this long")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-router-path", default=None,
                    help="directory holding the vllm_router package (pip install --target)")
    ap.add_argument("--out", default="benchmarks/results/router_capacity.json")
    args = ap.parse_args()
    logs = Path(f"/tmp/splitserve-capacity-{time.time():.0f}")
    logs.mkdir(parents=True)
    runs, rust_note = run(args, logs)
    report(args, runs, rust_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
