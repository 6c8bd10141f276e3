"""What prefill on D costs D's other streams: the stall of running decode streams while one
request's last N uncached prompt tokens are prefilled on the same worker (the router's
`--local-prefill-max-tokens N`).

One plain vLLM worker (the embedded demo model unless --model, float32, pinned to --cpus).
Per N: the prefill alone (a request whose prompt is a cached prefix of --prefix tokens plus N
new ones, max_tokens 1, the worker otherwise idle: its TTFT), then the same kind of request
sent while --streams decode streams run: their median inter-token gap, and the largest gap
that spans the injected prefill (the stall). Printed and written to
benchmarks/results/local_prefill_stall.json, never asserted.

    python benchmarks/local_prefill_stall.py [--model DIR] [--cpus 1] [--tokens 32 64 128 256 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import random_prompt, timed_stream, write_json  # noqa: E402

from splitserve.common.cpus import parse_cpus  # noqa: E402
from splitserve.common.procs import stop_group  # noqa: E402
from splitserve.config import WorkerConfig  # noqa: E402
from splitserve.demo_model import embedded_model_dir  # noqa: E402
from splitserve.worker.launch import free_port, start_worker, wait_healthy  # noqa: E402


def ttft(client: httpx.Client, model: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                             "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def one_n(client: httpx.Client, url: str, model: str, vocab: int, n: int, prefix: int,
          streams: int, seed: int) -> dict[str, Any]:
    base = random_prompt(prefix, seed, vocab)
    ttft(client, model, base)  # cache the prefix
    alone = [ttft(client, model, base + random_prompt(n, seed * 100 + i, vocab))
             for i in range(3)]
    results: list[Any] = []

    def stream(i: int) -> None:
        body = {"model": model, "prompt": random_prompt(64, seed * 1000 + i, vocab),
                "max_tokens": 120, "ignore_eos": True, "temperature": 0}
        results.append(timed_stream(httpx.Client(timeout=300), url, body))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the streams are decoding
    t0 = time.perf_counter()
    during = ttft(client, model, base + random_prompt(n, seed * 100 + 99, vocab))
    t1 = t0 + during
    for t in threads:
        t.join()
    gaps, spanning = [], []
    for st in results:
        for a, b in zip(st.chunks, st.chunks[1:], strict=False):
            (spanning if a < t1 and b > t0 else gaps).append(b - a)
    itl = statistics.median(gaps)
    return {"new_tokens": n, "prefill_alone_ms": round(statistics.median(alone) * 1e3, 1),
            "prefill_under_load_ms": round(during * 1e3, 1),
            "itl_median_ms": round(itl * 1e3, 1),
            "stall_max_gap_ms": round(max(spanning, default=0.0) * 1e3, 1),
            "stall_extra_ms": round((max(spanning, default=itl) - itl) * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    p.add_argument("--cpus", type=parse_cpus, default=(1,))
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--prefix", type=int, default=512, help="cached prefix tokens")
    p.add_argument("--streams", type=int, default=4, help="decode streams running")
    args = p.parse_args(argv)
    model_dir = args.model or str(embedded_model_dir())
    cfg = WorkerConfig(model=model_dir, port=free_port(), cpus=args.cpus)
    log = Path(f"/tmp/splitserve-local-prefill-{time.time():.0f}.log")
    proc = start_worker(cfg, None, str(log))
    try:
        wait_healthy(cfg.url, proc)
        client = httpx.Client(base_url=cfg.url, timeout=300)
        model = client.get("/v1/models").json()["data"][0]["id"]
        vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        rows = [one_n(client, cfg.url, model, vocab, n, args.prefix, args.streams, seed)
                for seed, n in enumerate(args.tokens, start=1)]
    finally:
        stop_group(proc, 20.0)
    for row in rows:
        print("  ".join(f"{k} {v}" for k, v in row.items()))
    write_json(Path(__file__).parent / "results" / "local_prefill_stall.json",
               {"cpus": list(args.cpus), "prefix": args.prefix, "streams": args.streams,
                "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
