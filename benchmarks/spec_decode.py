"""Speculative decoding on D: ITL and TPOT with and without n-gram drafting, in one run.

The workload must make drafts that are accepted, and a random model never repeats itself. So the
model is the tests' small Llama shape (vocabulary 1,024, 2 layers) with attention's output
projections scaled by 0.003 (`ModelSpec.attention_out_scale`, the tests' `llama-repeats`):
attention adds little, the next token depends mostly on the current one, and greedy output falls
into a cycle within some tens of tokens, which n-gram lookup then predicts. (The demo model's
shape, 4,096 tokens and 8 layers, did not repeat a 4-gram within 256 tokens.) It is a stand-in
for text that repeats itself (code edits, quoting, structured output), not a claim about a real
model's acceptance rate.

Arms (`splitserve bench compare --deploy`, one at a time on the same cores, the same stream):
1P+1D over shm without drafting, and with D drafting (`spec`); with `--colocated`, also a plain
worker without and with drafting. The stream: synthetic, `--num-prompts` prompts of
`--input-len` random tokens, `--output-len` greedy tokens each, Poisson at `--request-rate`.

Reports per arm: ITL p50 / p99 (between streamed chunks: a step that accepts drafts sends
several tokens in one chunk), TPOT p50 (per token), TTFT p50, output tokens/s, and the drafts'
acceptance (vLLM's `vllm:spec_decode_*` counters over the run). Timings are reported, never
asserted; take /tmp/splitserve-heavy.lock on a shared machine.

    python benchmarks/spec_decode.py [--num-prompts 24] [--output-len 256] [--colocated]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from splitserve.demo_model import ModelSpec, build_checkpoint, default_cache_dir, spec_digest

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
REPEATS = ModelSpec(arch="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                    max_position_embeddings=2048, seed=1, attention_out_scale=0.003)
KEYS = (("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
        ("median_tpot_ms", "TPOT p50 ms"), ("median_ttft_ms", "TTFT p50 ms"),
        ("output_throughput", "out tok/s"), ("spec_acceptance_rate", "draft acceptance"),
        ("spec_accepted_per_draft", "accepted / draft"))


def checkpoint() -> Path:
    out = default_cache_dir() / f"demo-model-{spec_digest(REPEATS)}"
    if not (out / "model.safetensors").exists():
        build_checkpoint(out, REPEATS)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--request-rate", type=float, default=0.5)
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--colocated", action="store_true",
                    help="also a plain worker without and with drafting")
    ap.add_argument("--out", default="results/spec_decode")
    args = ap.parse_args()

    arms = ["pd=disagg:shm", "pd_spec=disagg:shm:spec"]
    if args.colocated:
        arms += ["colocated=colocated", "colocated_spec=colocated:spec"]
    out = Path(args.out)
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "compare",
           "--deploy-model", str(checkpoint()), "--deploy-cores", args.cores,
           "--speculative-config", json.dumps(NGRAM), "--workload", "synthetic",
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--request-rate", str(args.request_rate),
           "--out", str(out)]
    for arm in arms:
        cmd += ["--deploy", arm]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)

    rows: dict[str, dict[str, Any]] = {}
    for arm in arms:
        name = arm.split("=", 1)[0]
        res = json.loads((out / f"{name}.json").read_text())
        rows[name] = {key: res.get(key) for key, _ in KEYS} | {
            "completed": res.get("completed"), "failed": res.get("failed")}
    print(f"\n{'':22}" + "".join(f"{n:>16}" for n in rows))
    for key, label in KEYS:
        cells = [rows[n][key] for n in rows]
        print(f"{label:22}" + "".join(f"{'-' if v is None else f'{v:.3g}':>16}" for v in cells))
    base, spec = rows["pd"], rows["pd_spec"]
    ratios = {k: spec[k] / base[k] for k in ("median_itl_ms", "median_tpot_ms",
                                               "output_throughput")
              if spec.get(k) and base.get(k)}
    print("1P+1D with drafting / without: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                          ratios.items()))
    summary = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "command": cmd,
               "speculative_config": NGRAM,
               "model": "tests' llama shape, attention_out_scale 0.003",
               "arms": rows, "pd_spec_over_pd": ratios}
    (out / "spec_decode.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'spec_decode.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
