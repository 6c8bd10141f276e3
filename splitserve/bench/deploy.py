"""Deployments the benchmark starts itself, at a given set of cores.

- `colocated`: one plain vLLM worker (no connector) on all the cores, with an optional token
  budget (`max_num_batched_tokens`: small = chunked prefill; at least the longest prompt = no
  chunking).
  Started with `splitserve.worker.launch`, reached directly (no router hop).
- `disagg`: prefill and decode workers (default 1P+1D, half the cores each) behind splitserve's
  router, started by the launcher (`splitserve.launch.local`), moving KV with splitserve's
  connector (`shm` or `tcp`), with vLLM's NixlConnector (`nixl`: D pulls P's blocks over UCX) or
  with vLLM's MooncakeConnector (`mooncake`: both legs at once, D pulls over Mooncake's tcp),
  with the router's routing policies (default: the router's, `cache`). More workers than cores
  share cores (the launcher's core plan says so in the run sheet). Its workers run with
  `--enable-prompt-tokens-details`, so the engine's cached-token count reaches the client and
  the router's predicted-against-reported counters.

Arm spec (`parse_arm`), for `bench compare --deploy`:

    NAME=colocated[:TOKEN_BUDGET][:spec]
    NAME=disagg[:FIELD[:FIELD...]]   each FIELD at most once, in any order, known by its form:
        shm | tcp | nixl | mooncake  KV path (default shm)
        <P>p<D>d                     shape: P prefill and D decode workers (default 1p1d)
        POLICY | PPOLICY/DPOLICY     router policy for both pools, or prefill/decode
                                     (default: the router's default, cache)
        blind                        the workers do not report their caches: the router
                                     knows nothing cached, so it never prefills on D nor
                                     sends a delta (the cache-blind baseline; default: they do)
        spec                         D drafts (speculative decoding) with the run's
                                     `--speculative-config`; on a colocated arm, its worker does

e.g. `cache=disagg:shm:2p2d:cache`, `load=disagg:2p2d:load:blind`, `mixed=disagg:tcp:cache/load`.
A `load` arm without `blind` still uses what the index knows: prefill on D and delta transfers
act under any policy.

`deployment(model, arm, log_dir)` (`model`: a resolved `hub.ModelSource`) is a context manager
yielding an `Endpoint` (URL + run-sheet notes); every process it started is stopped on exit.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.common import speculative
from splitserve.common.procs import stop_group
from splitserve.config import TRANSPORTS, WorkerConfig
from splitserve.hub import ModelSource
from splitserve.router.config import DECODE_POLICIES, PREFILL_POLICIES
from splitserve.routing import DEFAULT_POLICY
from splitserve.routing.prefix import LOCAL_PREFILL_MAX_TOKENS
from splitserve.worker.launch import free_port, start_worker, wait_healthy

ARM_KINDS: tuple[str, ...] = ("colocated", "disagg")
# a disaggregated arm's KV path: splitserve's connector over a transport, or vLLM's
# NixlConnector or MooncakeConnector
PULLED: tuple[str, ...] = ("nixl", "mooncake")
KV_PATHS: tuple[str, ...] = (*TRANSPORTS, *PULLED)
ARM_GRAMMAR = ("NAME=colocated[:TOKEN_BUDGET][:spec] or NAME=disagg[:FIELD...] with FIELDs "
               "(each at most once, any order): shm|tcp|nixl|mooncake, <P>p<D>d (e.g. 2p2d), "
               "POLICY or PREFILL_POLICY/DECODE_POLICY, blind, spec")
_SHAPE = re.compile(r"^([0-9]+)p([0-9]+)d$")
# what every started disaggregated arm passes to vLLM: the engine's cached-token count in usage
DISAGG_WORKER_ARGS: tuple[str, ...] = ("--enable-prompt-tokens-details",)


@dataclass(frozen=True)
class Arm:
    """One deployment under test."""

    name: str
    kind: str  # "colocated" or "disagg"
    cores: tuple[int, ...]
    max_num_batched_tokens: int | None = None
    transport: str = "shm"  # disagg only: splitserve's connector's transport
    connector: str = "splitserve"  # disagg only: "splitserve", "nixl" or "mooncake"
    prefill: int = 1  # disagg only: prefill workers
    decode: int = 1  # disagg only: decode workers
    prefill_policy: str = DEFAULT_POLICY  # disagg only: the router's policies
    decode_policy: str = DEFAULT_POLICY
    kv_events: bool = True  # disagg only: the workers report their caches (False: `blind`)
    speculative: str | None = None  # D's (or the colocated worker's) speculative config

    def __post_init__(self) -> None:
        if self.speculative is not None:
            object.__setattr__(self, "speculative", speculative.canonical(self.speculative))
            if self.kind == "disagg":
                speculative.check_for_role(self.speculative, "decode")
        if self.kind not in ARM_KINDS:
            raise ValueError(f"arm kind must be one of {ARM_KINDS}, got {self.kind!r}")
        if not self.cores or min(self.cores) < 0:
            raise ValueError(f"an arm needs core ids, got {self.cores}")
        if self.kind == "disagg" and len(self.cores) < 2:
            raise ValueError("a disaggregated arm needs at least two cores")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be at least 16")
        if self.connector not in ("splitserve", *PULLED):
            raise ValueError(f"connector must be splitserve, nixl or mooncake, "
                             f"got {self.connector!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("a disaggregated arm needs at least one prefill and one decode "
                             f"worker, got {self.prefill}p{self.decode}d")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill policy must be one of {PREFILL_POLICIES}, "
                             f"got {self.prefill_policy!r}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode policy must be one of {DECODE_POLICIES}, "
                             f"got {self.decode_policy!r}")

    def description(self, longest_prompt: int | None = None) -> dict[str, Any]:
        """The run sheet's deployment entry."""
        if self.kind == "colocated":
            budget = self.max_num_batched_tokens
            chunked = None if budget is None or longest_prompt is None else budget < longest_prompt
            return {"roles": ["colocated"], "cores_per_worker": [len(self.cores)],
                    "total_cores": len(self.cores), "transport": None,
                    "max_num_batched_tokens": budget, "chunked_prefill": chunked,
                    "router": False, "speculative": self.speculative}
        from splitserve.launch.local import plan_cores

        n = self.prefill + self.decode
        plan = plan_cores(list(self.cores), n)
        return {"roles": ["prefill"] * self.prefill + ["decode"] * self.decode,
                "shape": f"{self.prefill}P+{self.decode}D",
                "cores_per_worker": [len(c) for c in plan.workers],
                "total_cores": len(self.cores), "shared_cores": len(self.cores) < n,
                "core_plan": plan.note, "connector": self.connector,
                "transport": self.transport if self.connector == "splitserve" else None,
                "chunked_prefill": False, "router": True,
                "prefill_policy": self.prefill_policy, "decode_policy": self.decode_policy,
                "local_prefill_max_tokens": LOCAL_PREFILL_MAX_TOKENS,
                "kv_events": self.kv_events, "speculative": self.speculative,
                "worker_args": list(DISAGG_WORKER_ARGS)}


def parse_arm(text: str, cores: tuple[int, ...], speculative_config: str | None = None) -> Arm:
    """An `Arm` on `cores` from its spec (the grammar in the module docstring); ValueError
    naming the grammar and the offending part when the spec is not one. `speculative_config`:
    the run's, which an arm with the `spec` field drafts with."""
    name, sep, spec = text.partition("=")
    kind, _, rest = spec.partition(":")
    if not sep or not name or kind not in ARM_KINDS:
        raise ValueError(f"expected {ARM_GRAMMAR}; got {text!r}")
    parts = rest.split(":") if rest else []
    drafts = None
    if "spec" in parts:
        parts.remove("spec")
        if speculative_config is None:
            raise ValueError(f"{text!r} drafts (`spec`), but no --speculative-config was given")
        drafts = speculative_config
    if kind == "colocated":
        if len(parts) > 1 or (parts and not parts[0].isdigit()):
            raise ValueError(f"a colocated arm takes its token budget (an integer) and `spec`; "
                             f"got {text!r}")
        return Arm(name, kind, cores, int(parts[0]) if parts else None, speculative=drafts)
    fields: dict[str, Any] = {}

    def put(key: str, value: Any, part: str) -> None:
        if key in fields:
            raise ValueError(f"{text!r}: {part!r} sets the {key} twice ({ARM_GRAMMAR})")
        fields[key] = value

    for part in parts:
        if part in KV_PATHS:
            put("kv path", part, part)
        elif part == "blind":
            put("blind", True, part)
        elif m := _SHAPE.match(part):
            put("shape", (int(m.group(1)), int(m.group(2))), part)
        elif part.partition("/")[0] in PREFILL_POLICIES:
            pre, slash, dec = part.partition("/")
            if slash and dec not in DECODE_POLICIES:
                raise ValueError(f"{text!r}: decode policy {dec!r} is not one of "
                                 f"{DECODE_POLICIES}")
            put("policy", (pre, dec if slash else pre), part)
        else:
            raise ValueError(f"{text!r}: {part!r} is neither a KV path {KV_PATHS}, a shape "
                             f"(<P>p<D>d, e.g. 2p2d), a policy {PREFILL_POLICIES} "
                             f"(or PREFILL/DECODE) nor `blind`; expected {ARM_GRAMMAR}")
    path = fields.get("kv path", "shm")
    prefill, decode = fields.get("shape", (1, 1))
    p_policy, d_policy = fields.get("policy", (DEFAULT_POLICY, DEFAULT_POLICY))
    pulled = path in PULLED
    return Arm(name, kind, cores, transport="shm" if pulled else path,
               connector=path if pulled else "splitserve", prefill=prefill, decode=decode,
               prefill_policy=p_policy, decode_policy=d_policy,
               kv_events=not fields.get("blind", False), speculative=drafts)


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
                       cpus=arm.cores, max_num_batched_tokens=arm.max_num_batched_tokens,
                       speculative_config=arm.speculative)
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
    """The arm's P and D workers (1P+1D unless it says) on its cores through the launcher
    (`splitserve.launch.local`: with two cores and 1P+1D each worker gets one and the router
    shares them; more workers than cores share cores round-robin), its router running the
    arm's policies. Each call starts fresh processes: every cache starts cold."""
    from splitserve.launch.config import DeploymentConfig
    from splitserve.launch.local import LocalDeployment

    notes: list[str] = []
    # a hub id at its resolved commit (the colocated arm's snapshot, served under the same
    # name), else the directory
    cfg = DeploymentConfig(prefill=arm.prefill, decode=arm.decode,
                           model=model.name or model.path,
                           revision=model.revision if model.name else None,
                           transport=arm.transport,
                           connector=arm.connector, port=free_port(), cpus=arm.cores,
                           log_dir=str(log_dir / arm.name), startup_timeout_s=240.0,
                           prefill_policy=arm.prefill_policy, decode_policy=arm.decode_policy,
                           worker_args=DISAGG_WORKER_ARGS, kv_events=arm.kv_events,
                           speculative=arm.speculative)
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
