"""Why a worker did not start, in splitserve's terms: vLLM's start-up errors that a flag of ours
fixes, recognised in the worker's output and restated with the flag to change.

`explain_start_failure(output)` returns one sentence or None (nothing recognised: the output
itself is the explanation). `splitserve worker` prints it after vLLM's own output;
`wait_healthy` (the launcher, `splitserve serve`) adds it to its error.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

# vllm.v1.core.kv_cache_utils._check_enough_kv_cache_memory (vLLM 0.32.0)
_KV_TOO_SMALL = re.compile(
    r"To serve at least one request with the model's max seq len \((?P<len>\d+)\), "
    r"\((?P<need>[\d.]+) GiB KV cache is needed, which is larger than the available KV cache "
    r"memory \((?P<have>[\d.]+) GiB\)\.(?: Based on the available memory, the estimated maximum "
    r"model length is (?P<fits>\d+)\.)?")
# vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory (vLLM 0.32.0)
_KV_OVER_RAM = re.compile(
    r"Available memory on node \d+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on kv cache "
    r"allocation is less than requested memory for kv \((?P<want>[\d.]+)")
KV_MEMORY = "--kv-cache-gib (VLLM_CPU_KVCACHE_SPACE)"
TAIL_BYTES = 256 * 1024


def explain_start_failure(output: str) -> str | None:
    """One sentence naming the splitserve setting that fixes vLLM's start-up error in
    `output`, or None when no known error is there."""
    m = _KV_TOO_SMALL.search(output)
    if m:
        need, length = float(m["need"]), int(m["len"])
        fits = (f"--max-model-len {m['fits']} or less (the longest it holds)"
                if m["fits"] else "a smaller --max-model-len")
        return (f"the KV cache cannot hold one sequence of {length} tokens (the model's own "
                f"length, or --max-model-len): that needs {m['need']} GiB of KV cache and "
                f"{KV_MEMORY} gives {m['have']} GiB; start with {fits}, or with --kv-cache-gib "
                f"{math.floor(need) + 1} or more")
    m = _KV_OVER_RAM.search(output)
    if m:
        return (f"{KV_MEMORY} asks for {m['want']} GiB of KV cache but only {m['free']} of "
                f"{m['total']} GiB of memory are free; give a smaller {KV_MEMORY}")
    return None


def explain_log(path: str | Path) -> str | None:
    """`explain_start_failure` on the last `TAIL_BYTES` of a worker's log file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    return explain_start_failure(tail)
