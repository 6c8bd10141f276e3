"""The router's exact cache index (`splitserve.kvindex.index`): memory per block and the cost of
its operations, on synthetic keys. No server; printed and written to
benchmarks/results/kvindex_memory.json, never asserted (tests/kvindex asserts the bound).

- bytes per distinct block (tracemalloc), with one worker and with a second worker holding the
  same blocks;
- `apply_snapshot` and `forget` per 1,000 blocks;
- `matched` of one prompt against every worker (keys computed once, as the router does), and
  keying the prompt (`prefix_keys`).

    python benchmarks/kvindex_memory.py [--blocks 100000] [--workers 4] [--prompt 4096]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

from splitserve.kvindex.index import KvIndex
from splitserve.kvindex.messages import KvSnapshot


def snapshot_json(keys: list[int], epoch: str) -> str:
    return json.dumps({"epoch": epoch, "seq": 0, "block_size": 128, "keys": keys})


def measure(blocks: int, workers: int, prompt_len: int) -> dict[str, float]:
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(blocks)]
    raw = snapshot_json(keys, "e")
    idx = KvIndex()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx.apply_snapshot("w0", KvSnapshot.from_json(json.loads(raw)))
    gc.collect()
    one = tracemalloc.get_traced_memory()[0] - base
    idx.apply_snapshot("w1", KvSnapshot.from_json(json.loads(raw)))
    gc.collect()
    shared = tracemalloc.get_traced_memory()[0] - base - one
    tracemalloc.stop()

    snap = KvSnapshot.from_json(json.loads(raw))
    t0 = time.perf_counter()
    for w in range(2, workers):
        idx.apply_snapshot(f"w{w}", snap)
    per_snapshot = (time.perf_counter() - t0) / max(workers - 2, 1)
    t0 = time.perf_counter()
    idx.forget("w1")
    forget = time.perf_counter() - t0

    ids = list(range(prompt_len))
    t0 = time.perf_counter()
    for _ in range(100):
        prompt_keys = idx.prompt_keys(ids)
    keying = (time.perf_counter() - t0) / 100
    names = idx.workers()
    t0 = time.perf_counter()
    for _ in range(1000):
        idx.matched(names, keys=prompt_keys)
    matching = (time.perf_counter() - t0) / 1000
    return {"blocks": blocks, "workers": workers, "prompt_tokens": prompt_len,
            "bytes_per_block": round(one / blocks, 1),
            "bytes_per_shared_block": round(shared / blocks, 2),
            "snapshot_ms_per_1k_blocks": round(per_snapshot / blocks * 1e6, 3),
            "forget_ms_per_1k_blocks": round(forget / blocks * 1e6, 3),
            "prompt_keys_us": round(keying * 1e6, 1),
            "matched_us": round(matching * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=4096)
    args = p.parse_args(argv)
    out = measure(args.blocks, args.workers, args.prompt)
    for k, v in out.items():
        print(f"{k:28s} {v}")
    path = Path(__file__).parent / "results" / "kvindex_memory.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
