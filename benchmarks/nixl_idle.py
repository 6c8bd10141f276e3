"""NIXL on the CPU as vLLM ships it vs as splitserve runs it: idle CPU of a 1P1D, where each
worker's forward thread runs, and whether D's pull waits behind a prefill running on P.

Two variants, each a fresh 1P1D of `splitserve worker --connector nixl` (P on core 0, D on
core 1, the demo model, float32):
- `vllm-default`: `--nixl-progress-delay-us 0` and vLLM's affinity move kept (nixl's zero
  progress delay: the UCX progress thread spins; the forward thread on the last core);
- `splitserve`: the defaults (a 10 ms progress poll timeout; the forward thread keeps `--cpus`).

Per variant: each worker's CPU use over `--idle-s` idle seconds (cores), the cores the engine's
threads may run on, and D's pull under load: a short prompt's D leg sent while P prefills a
`--long`-token prompt (D's time to its first token against the same leg with P idle).
Printed and written to benchmarks/results/nixl_idle.json, never asserted.

    python benchmarks/nixl_idle.py [--model DIR] [--idle-s 5] [--long 3500] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import random_prompt, stop, summary, write_json  # noqa: E402

from splitserve.config import WorkerConfig, bearer_headers, new_token  # noqa: E402
from splitserve.worker.launch import free_port, start_worker, wait_healthy  # noqa: E402

VARIANTS = {"vllm-default": {"nixl_progress_delay_us": 0, "nixl_keep_affinity": False},
            "splitserve": {}}


def group_cpu(pgid: int) -> float:
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def thread_cores(pgid: int) -> dict[str, list[int]]:
    """Thread name -> allowed cores, for every thread of the group (the engine's included)."""
    out: dict[str, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            for tid in os.listdir(f"/proc/{name}/task"):
                comm = Path(f"/proc/{name}/task/{tid}/comm").read_text().strip()
                cores = sorted(os.sched_getaffinity(int(tid)))
                out[f"{name}/{comm}/{tid}"] = cores
        except OSError:
            continue
    return out


def forward_thread_cores(threads: dict[str, list[int]]) -> list[list[int]]:
    """The cores of the thread that runs the forward pass (and constructs vLLM's
    NixlConnectorWorker): the main thread of the model-runner process (`VLLM::Worker`, where
    vLLM runs one), else of the engine process (`VLLM::EngineCore`)."""
    mains = {key: cores for key, cores in threads.items()
             if key.split("/")[0] == key.split("/")[-1]}
    for comm in ("VLLM::Worker", "EngineCor"):
        found = sorted({tuple(cores) for key, cores in mains.items() if comm in key})
        if found:
            return [list(cores) for cores in found]
    return []


def leg(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def d_first_token(client: httpx.Client, p: str, d: str, prompt: list[int],
                  busy: list[int] | None) -> float:
    """Seconds from D's leg to its first token; with `busy`, while P prefills `busy`."""
    base = {"model": "m", "temperature": 0, "return_token_ids": True}
    answer = leg(client, p, base | {"prompt": prompt, "max_tokens": 1,
                                    "kv_transfer_params": {"do_remote_decode": True}})
    t1 = answer["choices"][0]["token_ids"][0]
    worker = None
    if busy is not None:
        worker = threading.Thread(target=leg, args=(client, p, base | {
            "prompt": busy, "max_tokens": 1}))
        worker.start()
        time.sleep(0.15)  # P is inside the long prefill's step
    start = time.perf_counter()
    leg(client, d, base | {"prompt": prompt + [t1], "max_tokens": 1, "ignore_eos": True,
                           "kv_transfer_params": answer["kv_transfer_params"]})
    took = time.perf_counter() - start
    if worker is not None:
        worker.join()
    return took


def run_variant(name: str, model: str, args: argparse.Namespace, token: str,
                log_dir: Path) -> dict[str, Any]:
    cfgs = [replace(WorkerConfig(model=model, port=free_port(), role=role,  # type: ignore[arg-type]
                                 kv_port=free_port(), connector="nixl", cpus=(core,),
                                 served_model_name="m", max_model_len=8192),
                    **VARIANTS[name])
            for role, core in (("prefill", 0), ("decode", 1))]
    procs = [start_worker(cfg, token, str(log_dir / f"{name}-{cfg.role}.log")) for cfg in cfgs]
    try:
        for cfg, proc in zip(cfgs, procs, strict=True):
            wait_healthy(cfg.url, proc, 600, token)
        p, d = (c.url for c in cfgs)
        with httpx.Client(headers=bearer_headers(token)) as client:
            d_first_token(client, p, d, random_prompt(64, 1, 1000), None)  # warm the pair
            time.sleep(2.0)
            before = [group_cpu(pr.pid) for pr in procs]
            t0 = time.monotonic()
            time.sleep(args.idle_s)
            wall = time.monotonic() - t0
            idle = [(group_cpu(pr.pid) - b) / wall for pr, b in zip(procs, before, strict=True)]
            threads = {str(c.role): thread_cores(pr.pid) for c, pr in zip(cfgs, procs, strict=True)}
            quiet, loaded = [], []
            for rep in range(args.reps):
                quiet.append(d_first_token(client, p, d, random_prompt(64, 10 + rep, 1000),
                                           None))
                loaded.append(d_first_token(client, p, d, random_prompt(64, 20 + rep, 1000),
                                            random_prompt(args.long, 30 + rep, 1000)))
    finally:
        for proc in procs:
            stop(proc)
    forward = {role: forward_thread_cores(ts) for role, ts in threads.items()}
    return {"idle_cores": {"prefill": idle[0], "decode": idle[1]},
            "forward_thread_cores": forward,
            "d_first_token_p_idle": summary(quiet), "d_first_token_p_prefilling": summary(loaded)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--long", type=int, default=3500, help="P's prefill while D pulls (tokens)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/nixl_idle.json")
    args = ap.parse_args()
    if args.model is None:
        from splitserve.demo_model import embedded_model_dir

        args.model = str(embedded_model_dir())
    log_dir = Path("benchmarks/results/logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    token = new_token()
    results: dict[str, Any] = {"model": args.model, "idle_s": args.idle_s, "long": args.long}
    for name in args.variants.split(","):
        results[name] = run_variant(name, args.model, args, token, log_dir)
        r = results[name]
        print(f"{name:13s} idle cores P {r['idle_cores']['prefill']:.3f} "
              f"D {r['idle_cores']['decode']:.3f}; forward thread cores "
              f"{r['forward_thread_cores']}; D first token P idle "
              f"{r['d_first_token_p_idle'].get('median_ms', 0):.1f} ms, P prefilling "
              f"{r['d_first_token_p_prefilling'].get('median_ms', 0):.1f} ms", flush=True)
    write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
