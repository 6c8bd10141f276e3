"""Deployments the benchmark starts itself, at a given set of cores.

- `colocated`: one plain vLLM worker (no connector) on all the cores, with an optional token
  budget (`max_num_batched_tokens`: small = chunked prefill; at least the longest prompt = no
  chunking).
- `disagg`: one prefill and one decode worker (half the cores each) with splitserve's connector,
  behind `splitserve router`. The workers are started with `splitserve.worker.launch` (roles
  `prefill`/`decode`, one deployment token in the environment), the router with its CLI.

`deployment(model, arm, log_dir)` is a context manager yielding the endpoint URL; every process
it started is stopped on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.config import TOKEN_ENV, WorkerConfig, new_token
from splitserve.worker.launch import free_port, start_worker, wait_healthy

ARM_KINDS: tuple[str, ...] = ("colocated", "disagg")


@dataclass(frozen=True)
class Arm:
    """One deployment under test."""

    name: str
    kind: str  # "colocated" or "disagg"
    cores: tuple[int, ...]
    max_num_batched_tokens: int | None = None
    transport: str = "shm"  # disagg only

    def __post_init__(self) -> None:
        if self.kind not in ARM_KINDS:
            raise ValueError(f"arm kind must be one of {ARM_KINDS}, got {self.kind!r}")
        if not self.cores or min(self.cores) < 0:
            raise ValueError(f"an arm needs core ids, got {self.cores}")
        if self.kind == "disagg" and len(self.cores) < 2:
            raise ValueError("a disaggregated arm needs at least two cores")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be at least 16")

    def description(self, longest_prompt: int | None = None) -> dict[str, Any]:
        """The run sheet's deployment entry."""
        if self.kind == "colocated":
            budget = self.max_num_batched_tokens
            chunked = None if budget is None or longest_prompt is None else budget < longest_prompt
            return {"roles": ["colocated"], "cores_per_worker": [len(self.cores)],
                    "total_cores": len(self.cores), "transport": None,
                    "max_num_batched_tokens": budget, "chunked_prefill": chunked,
                    "router": False}
        half = len(self.cores) // 2
        return {"roles": ["prefill", "decode"],
                "cores_per_worker": [half, len(self.cores) - half],
                "total_cores": len(self.cores), "transport": self.transport,
                "chunked_prefill": False, "router": True}


def parse_arm(text: str, cores: tuple[int, ...]) -> Arm:
    """NAME=colocated[:BUDGET] or NAME=disagg[:TRANSPORT], on `cores`."""
    name, sep, spec = text.partition("=")
    kind, _, arg = spec.partition(":")
    if not sep or not name or kind not in ARM_KINDS:
        raise ValueError(f"expected NAME=colocated[:BUDGET] or NAME=disagg[:shm|tcp], got {text!r}")
    if kind == "colocated":
        return Arm(name, kind, cores, int(arg) if arg else None)
    return Arm(name, kind, cores, transport=arg or "shm")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL it after 20 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def colocated_worker(model: str, arm: Arm, served_name: str, log_dir: Path) -> Iterator[str]:
    """A plain vLLM worker (no connector) on the arm's cores; yields its URL."""
    cfg = WorkerConfig(model=model, port=free_port(), cpus=arm.cores,
                       max_num_batched_tokens=arm.max_num_batched_tokens,
                       served_model_name=served_name)
    proc = start_worker(cfg, None, str(log_dir / f"{arm.name}.log"))
    try:
        wait_healthy(cfg.url, proc, timeout_s=240)
        yield cfg.url
    finally:
        stop_process(proc)


def start_router(prefill: str, decode: str, port: int, token: str,
                 log_path: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--prefill", prefill,
            "--decode", decode, "--port", str(port)]
    env = dict(os.environ) | {TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    out = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


@contextlib.contextmanager
def disagg_deployment(model: str, arm: Arm, served_name: str, log_dir: Path) -> Iterator[str]:
    """1P+1D on the arm's cores (P on the first half, D on the rest); yields the router URL."""
    half = len(arm.cores) // 2
    token = new_token()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cfgs = []
        for role, cpus in (("prefill", arm.cores[:half]), ("decode", arm.cores[half:])):
            cfg = WorkerConfig(model=model, port=free_port(), role=role,  # type: ignore[arg-type]
                               cpus=tuple(cpus), kv_port=free_port(),
                               transport=arm.transport,  # type: ignore[arg-type]
                               served_model_name=served_name)
            procs.append(start_worker(cfg, token, str(log_dir / f"{arm.name}-{role}.log")))
            cfgs.append(cfg)
        for cfg, proc in zip(cfgs, procs, strict=True):
            wait_healthy(cfg.url, proc, timeout_s=240)
        port = free_port()
        procs.append(start_router(cfgs[0].url, cfgs[1].url, port, token,
                                  log_dir / f"{arm.name}-router.log"))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs[-1], timeout_s=60)
        yield url
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def deployment(model: str, arm: Arm, served_name: str,
               log_dir: Path) -> contextlib.AbstractContextManager[str]:
    if arm.kind == "colocated":
        return colocated_worker(model, arm, served_name, log_dir)
    return disagg_deployment(model, arm, served_name, log_dir)
