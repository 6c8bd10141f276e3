"""What the router adds: per request, per streamed token, and its token throughput on one core,
against the same colocated worker reached directly; and the same numbers for `vllm-router` (the
Rust router from PyPI) in front of the same worker, when it is installed.

Each router is pinned to one core; the worker gets the rest. Requests to the targets are
interleaved so drift hits all alike. Printed and written to JSON, never asserted.

The colocated run adds `bare-relay` (`_bare_relay.py`, same core): uvicorn and one aiohttp
session relaying bytes with none of a router's work. It is the floor of splitserve's server
stack, so the run splits what the router costs into its stack's share and its own. Streaming
throughput runs `--rounds` times per target, interleaved, and sums chunks and CPU over them.

`--split`: the same for the two-leg path — splitserve in front of a P- and a D-worker (both on
the worker cores). Per request (`max_tokens: 1`, so only P is involved) against P reached
directly; per streamed token (D's leg relayed, each event re-framed) against D reached directly.
`--split --connector nixl`: the workers run vLLM's NixlConnector, and vllm-router's PD mode
(`--vllm-pd-disaggregation --kv-connector nixl`, when installed) sits in front of the same
workers too, on the same core. vllm-router always runs both legs (P with `max_tokens: 1`, then D
pulls and generates every token), so its per-request number includes a D leg that splitserve's
router skips when P's t1 is the whole answer; the streamed-token numbers compare like with
like. vllm-router's health checks and `/metrics` polls carry no `Authorization`, so splitserve's
token guard would refuse them: with `--connector nixl` the workers run without the deployment
token (open HTTP on loopback), for both routers alike.

    python benchmarks/router_overhead.py [--model DIR] [--requests 200] [--vllm-router-path DIR]
    python benchmarks/router_overhead.py --split [--connector splitserve|nixl]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import cpu_seconds, spawn, stop, summary, timed_stream, write_json  # noqa: E402

from splitserve.config import TOKEN_ENV, WorkerConfig, bearer_headers  # noqa: E402
from splitserve.demo_model import ModelSpec, build_checkpoint, default_cache_dir  # noqa: E402
from splitserve.worker.launch import (  # noqa: E402
    WorkerProcess,
    child_preexec,
    free_port,
    start_worker,
    wait_healthy,
    worker_command,
)

TINY = ModelSpec(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, seed=7)


def tiny_model() -> str:
    out = default_cache_dir() / "bench-tiny-llama"
    if not (out / "model.safetensors").exists():
        build_checkpoint(out, TINY)
    return str(out)


def request_latency(client: httpx.Client, urls: dict[str, str], model: str, n: int
                    ) -> dict[str, list[float]]:
    """Non-streaming one-token requests, interleaved over the targets."""
    out: dict[str, list[float]] = {k: [] for k in urls}
    body = {"model": model, "prompt": [11, 12, 13, 14], "max_tokens": 1, "temperature": 0}
    for i in range(n):
        for name, url in urls.items():
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/completions", json=body | {"prompt": [11 + i % 50, 12]})
            r.raise_for_status()
            out[name].append(time.perf_counter() - t0)
    return out


def token_gaps(client: httpx.Client, urls: dict[str, str], model: str, n: int, tokens: int
               ) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in urls}
    for i in range(n):
        for name, url in urls.items():
            body = {"model": model, "prompt": [20 + i % 50, 21, 22], "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True}
            out[name] += timed_stream(client, url, body).gaps
    return out


async def throughput(url: str, model: str, concurrency: int, tokens: int, pid: int | None,
                     token: str | None = None) -> dict[str, float]:
    body = {"model": model, "prompt": [30, 31, 32], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    received = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal received
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    received += 1

    cpu0 = cpu_seconds(pid) if pid else 0.0
    t0 = time.perf_counter()
    headers = bearer_headers(token)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None),
                                 headers=headers) as c:
        await asyncio.gather(*(one(c) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
    return {"chunks": received, "wall_s": wall, "chunks_per_s": received / wall,
            "router_cpu_s": cpu,
            "chunks_per_router_cpu_s": received / cpu if cpu else float("nan")}


def throughput_rounds(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace,
                      token: str | None = None) -> dict[str, dict[str, float]]:
    """`throughput` for every target, `--rounds` times interleaved so drift hits all alike;
    chunks and router CPU summed over the rounds (one round's CPU is a few clock ticks)."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
    for _ in range(args.rounds):
        for name, url in urls.items():
            runs[name].append(asyncio.run(throughput(url, "bench", args.concurrency, args.tokens,
                                                     pids.get(name), token)))
    out = {}
    for name, rs in runs.items():
        chunks = sum(r["chunks"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(r["router_cpu_s"] for r in rs)
        out[name] = {"chunks": chunks, "wall_s": wall, "chunks_per_s": chunks / wall,
                     "router_cpu_s": cpu,
                     "chunks_per_router_cpu_s": chunks / cpu if cpu else float("nan")}
    return out


def split_run(args: argparse.Namespace, model_dir: str, logs: Path, router_core: tuple[int, ...],
              worker_cores: tuple[int, ...]) -> tuple[dict[str, list[float]],
                                                      dict[str, list[float]], dict[str, Any],
                                                      dict[str, str]]:
    """(request latencies vs P, token gaps vs D, throughput, targets) of the split path."""
    token = secrets.token_hex(16)
    cfgs = [WorkerConfig(model=model_dir, port=free_port(), role=role, kv_port=free_port(),
                         cpus=worker_cores, max_model_len=2048, served_model_name="bench",
                         connector=args.connector)
            for role in ("prefill", "decode")]
    start = start_open_worker if args.connector == "nixl" else start_worker
    workers = [start(c, token, str(logs / f"{c.role}.log")) for c in cfgs]
    routers: list[Any] = []
    try:
        for c, w in zip(cfgs, workers, strict=True):
            wait_healthy(c.url, w, token=None if args.connector == "nixl" else token)
        port = free_port()
        routers.append(spawn([sys.executable, "-m", "splitserve.cli", "router", "--prefill",
                              cfgs[0].url, "--decode", cfgs[1].url, "--port", str(port),
                              "--log-level", "warning"], logs / "splitserve-router.log",
                             router_core, dict(os.environ, SPLITSERVE_TOKEN=token)))
        urls = {"splitserve": f"http://127.0.0.1:{port}"}
        started = {"splitserve": routers[0]}
        if args.connector == "nixl" and vllm_router_installed(args, logs):
            rust_port = free_port()
            routers.append(spawn([sys.executable, "-m", "vllm_router.launch_router",
                                  "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                                  "--prefill", cfgs[0].url, "--decode", cfgs[1].url,
                                  "--policy", "round_robin", "--host", "127.0.0.1",
                                  "--port", str(rust_port), "--prometheus-port", str(free_port()),
                                  "--worker-startup-check-interval", "1",
                                  "--log-level", "warning"],
                                 logs / "vllm-router.log", router_core, vllm_router_env(args)))
            urls["vllm-router"] = f"http://127.0.0.1:{rust_port}"
            started["vllm-router"] = routers[-1]
        pids = wait_started(urls, started, logs)
        # workers require the deployment token (the routers ignore it: no API key is set)
        with httpx.Client(timeout=120, headers=bearer_headers(token)) as client:
            token_gaps(client, urls, "bench", 2, 8)  # warm-up
            lat = request_latency(client, {"direct": cfgs[0].url} | urls, "bench",
                                  args.requests)
            gaps = token_gaps(client, {"direct": cfgs[1].url} | urls, "bench", args.streams,
                              args.tokens)
        thr = throughput_rounds({"direct": cfgs[1].url} | urls, pids, args, token)
    finally:
        for r in routers:
            stop(r)
        for w in workers:
            w.terminate()
            w.wait(30)
    return lat, gaps, thr, {"direct": ""} | urls


def start_open_worker(cfg: WorkerConfig, token: str, log: str) -> WorkerProcess:
    """A NIXL worker exactly as `splitserve worker --connector nixl` starts it, minus the
    deployment token in its environment, so its HTTP paths are open: vllm-router's health checks
    and `/metrics` polls carry no `Authorization`, and the token guard would refuse them. A NIXL
    worker needs the token for nothing else (NIXL's KV path has no authentication)."""
    argv, env = worker_command(cfg, token)
    env.pop(TOKEN_ENV, None)
    with open(log, "ab") as out:
        return WorkerProcess(argv, env, stdout=out, stderr=subprocess.STDOUT,
                             preexec_fn=child_preexec(cfg.cpus), start_new_session=True)


def wait_started(urls: dict[str, str], started: dict[str, subprocess.Popen[bytes]],
                 logs: Path) -> dict[str, int]:
    """Wait until every started router answers `/health`, failing as soon as one exits (its log
    is named); their pids by name."""
    for name, proc in started.items():
        try:
            wait_healthy(urls[name], proc, 120)
        except RuntimeError as exc:
            raise RuntimeError(f"{name} did not start ({exc}); see {logs}/") from exc
    return {name: proc.pid for name, proc in started.items()}


def vllm_router_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.vllm_router_path:
        env["PYTHONPATH"] = args.vllm_router_path + os.pathsep + env.get("PYTHONPATH", "")
    return env


def vllm_router_installed(args: argparse.Namespace, logs: Path) -> bool:
    probe = spawn([sys.executable, "-c", "import vllm_router"], logs / "probe.log",
                  env=vllm_router_env(args))
    return probe.wait(60) == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model directory (default: a tiny llama)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5,
                    help="streaming-throughput rounds per target, interleaved")
    ap.add_argument("--vllm-router-path", default=None,
                    help="directory holding the vllm_router package (pip install --target)")
    ap.add_argument("--split", action="store_true",
                    help="the two-leg path (a P- and a D-worker) instead of the colocated one")
    ap.add_argument("--connector", choices=("splitserve", "nixl"), default="splitserve",
                    help="--split: the workers' connector (nixl adds vllm-router's PD mode)")
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/router_overhead[_split].json")
    args = ap.parse_args()
    suffix = ("_split_nixl" if args.connector == "nixl" else "_split") if args.split else ""
    args.out = args.out or f"benchmarks/results/router_overhead{suffix}.json"
    model_dir = args.model or tiny_model()
    cores = sorted(os.sched_getaffinity(0))
    router_core, worker_cores = (cores[0],), tuple(cores[1:] or cores)
    logs = Path(f"/tmp/splitserve-overhead-{time.time():.0f}")
    logs.mkdir(parents=True)
    if args.split:
        lat, gaps, thr, urls = split_run(args, model_dir, logs, router_core, worker_cores)
        rust_note = ("installed" if "vllm-router" in urls else
                     "not run (its PD mode speaks NIXL's protocol: --connector nixl)"
                     if args.connector != "nixl" else "not installed (the bench extra)")
    else:
        lat, gaps, thr, urls, rust_note = colocated_run(args, model_dir, logs, router_core,
                                                         worker_cores)
    report(args, model_dir, router_core, worker_cores, rust_note, lat, gaps, thr, urls)
    return 0


def colocated_run(args: argparse.Namespace, model_dir: str, logs: Path,
                  router_core: tuple[int, ...], worker_cores: tuple[int, ...]
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any],
                             dict[str, str], str]:
    wcfg = WorkerConfig(model=model_dir, port=free_port(), cpus=worker_cores,
                        max_model_len=2048, served_model_name="bench")
    procs = []
    worker = start_worker(wcfg, None, str(logs / "worker.log"))
    try:
        wait_healthy(wcfg.url, worker)
        ours_port = free_port()
        ours = spawn([sys.executable, "-m", "splitserve.cli", "router", "--colocated", wcfg.url,
                      "--port", str(ours_port), "--log-level", "warning"],
                     logs / "splitserve-router.log", router_core)
        procs.append(ours)
        urls = {"direct": wcfg.url, "splitserve": f"http://127.0.0.1:{ours_port}"}
        started = {"splitserve": ours}
        rust_note = "not installed (pip install vllm-router, or --vllm-router-path)"
        if vllm_router_installed(args, logs):
            rust_port = free_port()
            rust = spawn([sys.executable, "-m", "vllm_router.launch_router", "--worker-urls",
                          wcfg.url, "--policy", "round_robin", "--port", str(rust_port),
                          "--host", "127.0.0.1", "--log-level", "warning"],
                         logs / "vllm-router.log", router_core, vllm_router_env(args))
            procs.append(rust)
            urls["vllm-router"] = f"http://127.0.0.1:{rust_port}"
            started["vllm-router"] = rust
            rust_note = "installed"
        bare_port = free_port()
        bare = spawn([sys.executable, str(Path(__file__).parent / "_bare_relay.py"),
                      "--upstream", wcfg.url, "--port", str(bare_port)],
                     logs / "bare-relay.log", router_core)
        procs.append(bare)
        urls["bare-relay"] = f"http://127.0.0.1:{bare_port}"
        started["bare-relay"] = bare
        pids = wait_started(urls, started, logs)
        with httpx.Client(timeout=120) as client:
            token_gaps(client, urls, "bench", 2, 8)  # warm-up
            lat = request_latency(client, urls, "bench", args.requests)
            gaps = token_gaps(client, urls, "bench", args.streams, args.tokens)
        thr = throughput_rounds(urls, pids, args)
    finally:
        for p in procs:
            stop(p)
        worker.terminate()
        worker.wait(30)
    return lat, gaps, thr, urls, rust_note


def report(args: argparse.Namespace, model_dir: str, router_core: tuple[int, ...],
           worker_cores: tuple[int, ...], rust_note: str, lat: dict[str, list[float]],
           gaps: dict[str, list[float]], thr: dict[str, Any], urls: dict[str, str]) -> None:
    base_lat = statistics.median(lat["direct"])
    base_gap = statistics.median(gaps["direct"])
    result: dict[str, Any] = {"benchmark": "router_overhead", "model": model_dir,
                              "path": "split" if args.split else "colocated",
                              "connector": args.connector if args.split else None,
                              "router_core": list(router_core), "worker_cores": list(worker_cores),
                              "vllm_router": rust_note, "targets": {}}
    if args.split:
        result["baselines"] = {"request": "P-worker reached directly",
                               "token": "D-worker reached directly"}
    print(f"{'target':>12} {'req p50 ms':>11} {'added ms':>9} {'ITL p50 ms':>11} "
          f"{'added/token ms':>15} {'chunks/s':>9} {'chunks/router-cpu-s':>20}")
    for name in urls:
        added_req = (statistics.median(lat[name]) - base_lat) * 1e3
        added_tok = (statistics.median(gaps[name]) - base_gap) * 1e3
        result["targets"][name] = {
            "request_latency_ms": summary(lat[name]), "added_request_ms": added_req,
            "itl_ms": summary(gaps[name]), "added_per_token_ms": added_tok,
            "throughput": thr[name]}
        print(f"{name:>12} {statistics.median(lat[name]) * 1e3:>11.2f} {added_req:>9.2f} "
              f"{statistics.median(gaps[name]) * 1e3:>11.2f} {added_tok:>15.3f} "
              f"{thr[name]['chunks_per_s']:>9.0f} {thr[name]['chunks_per_router_cpu_s']:>20.0f}")
    for other in ("vllm-router", "bare-relay"):
        if other not in urls:
            continue
        ours, theirs = result["targets"]["splitserve"], result["targets"][other]
        key = other.replace("-", "_")
        if not args.split or other != "vllm-router":  # its PD request runs a D leg too
            ratio = (ours["added_request_ms"] / theirs["added_request_ms"]
                     if theirs["added_request_ms"] > 0 else float("inf"))
            result[f"added_latency_ratio_vs_{key}"] = ratio
            print(f"added request latency, splitserve / {other}: {ratio:.2f}")
        cpu_ratio = (theirs["throughput"]["chunks_per_router_cpu_s"]
                     / ours["throughput"]["chunks_per_router_cpu_s"])
        result[f"cpu_per_chunk_ratio_vs_{key}"] = cpu_ratio
        print(f"router CPU per relayed chunk, splitserve / {other}: {cpu_ratio:.2f}")
    write_json(Path(args.out), result)


if __name__ == "__main__":
    sys.exit(main())
