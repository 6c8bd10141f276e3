"""Deployments the benchmark starts itself, at a given set of cores.

- `colocated`: one plain vLLM worker (no connector) on all the cores, with an optional token
  budget (`max_num_batched_tokens`: small = chunked prefill; at least the longest prompt = no
  chunking).
  Started with `splitserve.worker.launch`, reached directly (no router hop).
- `disagg`: one prefill and one decode worker (half the cores each) behind splitserve's router,
  started by the launcher (`splitserve.launch.local`), moving KV with splitserve's connector
  (`shm` or `tcp`) or with vLLM's NixlConnector (`nixl`: D pulls P's blocks over UCX).

`deployment(model, arm, log_dir)` (`model`: a resolved `hub.ModelSource`) is a context manager
yielding an `Endpoint` (URL + run-sheet notes); every process it started is stopped on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.common.procs import stop_group
from splitserve.config import TRANSPORTS, WorkerConfig
from splitserve.hub import ModelSource
from splitserve.worker.launch import free_port, start_worker, wait_healthy

ARM_KINDS: tuple[str, ...] = ("colocated", "disagg")
# a disaggregated arm's KV path: splitserve's connector over a transport, or vLLM's NixlConnector
KV_PATHS: tuple[str, ...] = (*TRANSPORTS, "nixl")


@dataclass(frozen=True)
class Arm:
    """One deployment under test."""

    name: str
    kind: str  # "colocated" or "disagg"
    cores: tuple[int, ...]
    max_num_batched_tokens: int | None = None
    transport: str = "shm"  # disagg only: splitserve's connector's transport
    connector: str = "splitserve"  # disagg only: "splitserve" or "nixl"

    def __post_init__(self) -> None:
        if self.kind not in ARM_KINDS:
            raise ValueError(f"arm kind must be one of {ARM_KINDS}, got {self.kind!r}")
        if not self.cores or min(self.cores) < 0:
            raise ValueError(f"an arm needs core ids, got {self.cores}")
        if self.kind == "disagg" and len(self.cores) < 2:
            raise ValueError("a disaggregated arm needs at least two cores")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be at least 16")
        if self.connector not in ("splitserve", "nixl"):
            raise ValueError(f"connector must be splitserve or nixl, got {self.connector!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")

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
                "total_cores": len(self.cores), "connector": self.connector,
                "transport": self.transport if self.connector == "splitserve" else None,
                "chunked_prefill": False, "router": True}


def parse_arm(text: str, cores: tuple[int, ...]) -> Arm:
    """NAME=colocated[:BUDGET] or NAME=disagg[:shm|tcp|nixl], on `cores`."""
    name, sep, spec = text.partition("=")
    kind, _, arg = spec.partition(":")
    if not sep or not name or kind not in ARM_KINDS:
        raise ValueError("expected NAME=colocated[:BUDGET] or NAME=disagg[:shm|tcp|nixl], "
                         f"got {text!r}")
    if kind == "colocated":
        return Arm(name, kind, cores, int(arg) if arg else None)
    path = arg or "shm"
    if path not in KV_PATHS:
        raise ValueError(f"a disaggregated arm's KV path is one of {KV_PATHS}, got {path!r}")
    if path == "nixl":
        return Arm(name, kind, cores, connector="nixl")
    return Arm(name, kind, cores, transport=path)


@dataclass(frozen=True)
class Endpoint:
    """A started deployment: its URL and what the run sheet should know about it."""

    url: str
    info: dict[str, Any]
    token: str | None = field(default=None, repr=False)  # the deployment's, for worker /metrics


@contextlib.contextmanager
def colocated_worker(model: ModelSource, arm: Arm, log_dir: Path) -> Iterator[Endpoint]:
    """A plain vLLM worker (no connector, no router) on all the arm's cores."""
    cfg = WorkerConfig(model=model.path, served_model_name=model.name, port=free_port(),
                       cpus=arm.cores, max_num_batched_tokens=arm.max_num_batched_tokens)
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = start_worker(cfg, None, str(log_dir / f"{arm.name}.log"))
    try:
        wait_healthy(cfg.url, proc, timeout_s=240)
        yield Endpoint(cfg.url, {"launcher": "splitserve.worker.launch",
                                 "worker_cpus": [list(arm.cores)]})
    finally:
        stop_group(proc, 20.0, reap_s=None)  # SIGKILL after 20 s, then reaped


@contextlib.contextmanager
def disagg_deployment(model: ModelSource, arm: Arm, log_dir: Path) -> Iterator[Endpoint]:
    """1P+1D on the arm's cores through the launcher (`splitserve.launch.local`): with two
    cores each worker gets one and the router shares them."""
    from splitserve.launch.config import DeploymentConfig
    from splitserve.launch.local import LocalDeployment

    notes: list[str] = []
    # a hub id at its resolved commit (the colocated arm's snapshot, served under the same
    # name), else the directory
    cfg = DeploymentConfig(prefill=1, decode=1, model=model.name or model.path,
                           revision=model.revision if model.name else None,
                           transport=arm.transport,
                           connector=arm.connector, port=free_port(), cpus=arm.cores,
                           log_dir=str(log_dir / arm.name), startup_timeout_s=240.0)
    with LocalDeployment(cfg, say=notes.append) as dep:
        yield Endpoint(dep.url, {"launcher": "splitserve.launch.local",
                                 "cores": dep.core_note,
                                 "worker_cpus": [list(w.cpus or ()) for w in dep.workers]},
                       dep.token)


def deployment(model: ModelSource, arm: Arm, log_dir: Path
               ) -> contextlib.AbstractContextManager[Endpoint]:
    """Start `arm` on `model`; stop everything on exit."""
    if arm.kind == "colocated":
        return colocated_worker(model, arm, log_dir)
    return disagg_deployment(model, arm, log_dir)
