"""A deployment's description: frozen, validated on construction, loadable from YAML.

YAML keys are the field names below; `router:` holds the router's policy fields. Example:

    model: embedded          # or a model directory, or a Hugging Face model id (org/name)
    # revision: main         # with a hub id (org/name): its branch, tag or commit
    prefill: 1
    decode: 1
    transport: tcp
    connector: splitserve    # or nixl / mooncake: vLLM's NixlConnector / MooncakeConnector
    port: 8000
    routers: 2               # optional: routers over the same workers, on ports 8000 and 8001
    router: {decode_policy: round_robin, local_prefill_max_tokens: 0}
    kv_events: false         # optional: workers do not report their prefix cache (default true)
    speculative: {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}  # D, colocated
    colocated_tp: 2          # optional: tensor parallelism per pool (also prefill_tp, decode_tp)
    kv_tls_cert: certs/kv.pem  # optional: TLS on the KV channel; one cert for every worker,
    kv_tls_key: certs/kv.key   # valid for `host`; kv_tls_ca verifies it (and makes TLS mutual)
    kv_tls_ca: certs/ca.pem
    backend: ray             # optional: run on a Ray cluster (default: local processes)
    ray_address: 10.0.0.1:6379  # the cluster to join; omitted: a local one is started
    ray: {prefill_resources: {prefill: 1}, decode_resources: {decode: 1}}  # see rayconfig
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from splitserve.common import speculative
from splitserve.common.cpus import check_cpus_usable, check_distinct, parse_cpus
from splitserve.common.vocab import Connector, values
from splitserve.config import (
    TRANSPORTS,
    check_kv_events_passthrough,
    check_kv_memory_passthrough,
    check_tensor_parallel,
    check_tls_files,
)
from splitserve.hub import check_model_name
from splitserve.launch.rayconfig import RayOptions, ray_options
from splitserve.router.config import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    UNSPLITTABLE_MODES,
)
from splitserve.routing import DEFAULT_POLICY, CacheWeights
from splitserve.routing.prefix import LOCAL_PREFILL_MAX_TOKENS
from splitserve.secretflags import check_passthrough

ROUTER_KEYS = ("prefill_policy", "decode_policy", "unsplittable", "max_inflight",
               "local_prefill_max_tokens", "prefill_hit_weight", "decode_hit_weight")
BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class DeploymentConfig:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    # a model directory, a Hugging Face model id, or "embedded" for the generated demo model
    model: str = "embedded"
    revision: str | None = None  # of a hub id (default: main)
    dtype: str = "float32"
    transport: str = "tcp"
    connector: str = Connector.SPLITSERVE.value
    host: str = "127.0.0.1"
    port: int = 8000  # the router's port; workers get free loopback ports
    routers: int = 1  # routers over the same workers, on ports port .. port + routers - 1
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own length
    kv_cache_gib: int = 1
    staging_mib: int = 512
    kv_lease_s: float = 60.0  # splitserve: D's staging lease; nixl, mooncake: P's held blocks'

    cpus: tuple[int, ...] | None = None  # cores to use (default: this process's affinity)
    # the router's cores (default: a core of its own when there are workers + 1, else all)
    router_cpus: tuple[int, ...] | None = None
    log_dir: str | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 20.0
    prefill_policy: str = DEFAULT_POLICY
    decode_policy: str = DEFAULT_POLICY
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # prefill on D (0: off)
    prefill_hit_weight: float = 1.0  # `cache`'s weights (`routing.CacheWeights`)
    decode_hit_weight: float = 1.0
    unsplittable: str = "whole"
    max_inflight: int = 4096
    kv_tls_cert: str | None = None  # TLS on the KV channel: shared by every P and D worker
    kv_tls_key: str | None = None
    kv_tls_ca: str | None = None
    # every worker reports its prefix cache to routers (worker.kvrelay); false: none does
    kv_events: bool = True
    # vLLM's speculative config (JSON text, or a mapping in YAML) for D and colocated workers
    speculative: str | None = None
    # tensor parallelism per pool: ranks of each worker's engine (each rank gets its own cores)
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1
    worker_args: tuple[str, ...] = field(default_factory=tuple)  # passed to vLLM unchanged
    backend: str = "local"  # local processes, or a Ray cluster
    ray_address: str | None = None  # backend ray: the cluster's address; None starts one
    ray: RayOptions = field(default_factory=RayOptions)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "colocated"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode go together (both at least 1)")
        if self.prefill + self.colocated == 0:
            raise ValueError("nothing to start: give --prefill N --decode M, or --colocated K")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}")
        if self.connector not in values(Connector):
            raise ValueError(f"connector must be one of {values(Connector)}")
        if self.connector != Connector.SPLITSERVE and self.kv_tls_cert is not None:
            raise ValueError(f"kv TLS is splitserve's connector's; {self.connector}'s transfers "
                             "are not encrypted (keep them on a trusted network)")
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError("dtype must be float32, bfloat16 or auto")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be a TCP port, got {self.port}")
        if not isinstance(self.routers, int) or self.routers < 1:
            raise ValueError(f"routers must be at least 1, got {self.routers!r}")
        if self.port + self.routers - 1 > 65535:
            raise ValueError(f"{self.routers} routers from port {self.port} run past 65535")
        self._check_sizes()
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy must be one of {PREFILL_POLICIES}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_policy must be one of {DECODE_POLICIES}")
        if self.unsplittable not in UNSPLITTABLE_MODES:
            raise ValueError(f"unsplittable must be one of {UNSPLITTABLE_MODES}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must not be negative (0 turns it off)")
        CacheWeights(self.prefill_hit_weight, self.decode_hit_weight)  # validates them
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be positive (omit it for the model's own)")
        if self.model == "embedded":
            if self.revision is not None:
                raise ValueError("revision applies to a Hugging Face model id, not the embedded "
                                 "model")
        elif self.files_here:  # on a remote Ray cluster the model lives on its nodes
            check_model_name(self.model, self.revision)
        if not all(isinstance(a, str) for a in self.worker_args):
            raise ValueError(f"worker_args are command-line words, each a string (quote numbers "
                             f"in YAML): {list(self.worker_args)!r}")
        check_passthrough(self.worker_args)
        if not isinstance(self.kv_events, bool):
            raise ValueError(f"kv_events must be true or false, got {self.kv_events!r}")
        check_kv_events_passthrough(self.worker_args, self.kv_events)
        check_kv_memory_passthrough(self.worker_args)
        self._check_engines()
        check_tls_files(self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca, prefix="kv_tls_",
                        must_exist=self.files_here)
        if self.kv_tls_cert is not None and not self.prefill:
            raise ValueError("kv TLS encrypts the channel between prefill and decode workers; "
                             "this deployment has none")

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        if self.ray_address is not None and self.backend != "ray":
            raise ValueError("ray_address needs backend: ray")
        object.__setattr__(self, "ray", ray_options(self.ray))
        for kind in ("prefill", "decode"):
            self.ray.bounds(kind, getattr(self, kind))

    def _check_engines(self) -> None:
        """The engines' own options: each pool's TP degree, the speculative config (D and
        colocated workers only, so never after `--`, which reaches P too)."""
        if (flag := speculative.passthrough_flag(self.worker_args)) is not None:
            raise ValueError(f"{flag} after `--` would reach every worker, P too: give it as "
                             "--speculative-config (YAML: speculative), which goes to decode "
                             "and colocated workers only")
        for pool in ("prefill", "decode", "colocated"):
            if not isinstance(tp := getattr(self, f"{pool}_tp"), int):
                raise ValueError(f"{pool}_tp must be a whole number, got {tp!r}")
            try:
                check_tensor_parallel(tp, self.worker_args)
            except ValueError as exc:
                raise ValueError(f"{pool}_tp: {exc}") from None
        if self.speculative is not None:
            object.__setattr__(self, "speculative", speculative.canonical(self.speculative))
            if self.prefill:
                speculative.check_for_role(self.speculative, "decode")

    def _check_sizes(self) -> None:
        """The numbers that size the deployment (memory, limits, timeouts) and its cores."""
        if self.kv_lease_s <= 0:
            raise ValueError("kv_lease_s must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        for key in ("kv_cache_gib", "staging_mib", "max_inflight"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("startup_timeout_s", "stop_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        for key in ("cpus", "router_cpus"):
            cores = getattr(self, key)
            if cores is not None and not cores:
                raise ValueError(f"{key} must not be empty")
            if cores is not None:
                check_distinct(cores, key)
        if self.backend == "local":  # the cores of this machine (the Ray backend ignores both)
            check_cpus_usable(self.cpus, "cpus")
            check_cpus_usable(self.router_cpus, "router_cpus")

    @property
    def files_here(self) -> bool:
        """Whether the workers read their files (model, TLS) on this machine."""
        return self.backend == "local" or self.ray_address is None

    @property
    def router_ports(self) -> tuple[int, ...]:
        """Each router's port: `port`, `port + 1`, ..."""
        return tuple(range(self.port, self.port + self.routers))

    @property
    def n_workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    def tp_of(self, pool: str) -> int:
        """The tensor-parallel degree of `pool`'s workers ("prefill", "decode", "colocated")."""
        return int(getattr(self, f"{pool}_tp"))


def from_mapping(data: dict[str, Any], overrides: dict[str, Any] | None = None
                 ) -> DeploymentConfig:
    """Build from a YAML-shaped mapping; `overrides` (non-None values) win."""
    flat = {k: v for k, v in data.items() if k != "router"}
    router = data.get("router") or {}
    if not isinstance(router, dict):
        raise ValueError("`router:` must be a mapping")
    unknown_router = set(router) - set(ROUTER_KEYS)
    if unknown_router:
        raise ValueError(f"unknown router keys: {sorted(unknown_router)}")
    flat.update(router)
    flat.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {f.name for f in fields(DeploymentConfig)}
    unknown = set(flat) - known
    if unknown:
        raise ValueError(f"unknown deployment keys: {sorted(unknown)}")
    for key in ("cpus", "router_cpus"):  # "0-3,6" as the flag takes it, a core, or a list
        value = flat.get(key)
        if isinstance(value, str):
            try:
                flat[key] = parse_cpus(value)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        elif isinstance(value, int) and not isinstance(value, bool):
            flat[key] = (value,)
    for key in ("cpus", "router_cpus", "worker_args"):
        if key in flat and flat[key] is not None:
            if not isinstance(flat[key], list | tuple):
                raise ValueError(f"{key}: expected a list, got {flat[key]!r}")
            flat[key] = tuple(flat[key])
    _check_scalar_types(flat)
    try:
        return DeploymentConfig(**flat)
    except TypeError as exc:  # a value of a type its check does not expect
        raise ValueError(f"a deployment value of the wrong type: {exc}") from None


SCALARS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number",
                            str: "a string"}
TAKES_A_MAPPING = ("speculative", "ray")  # a YAML mapping stands for these (see the fields)


def _check_scalar_types(flat: dict[str, Any]) -> None:
    """ValueError naming the key for a value that is not of its field's scalar type (bool, int,
    float or str, whether or not the field allows None; an int stands for a float)."""
    hints = typing.get_type_hints(DeploymentConfig)
    for name, value in flat.items():
        if value is None or name in TAKES_A_MAPPING:
            continue
        hint = hints[name]
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        scalars = [t for t in members if t in SCALARS]
        if not scalars:
            continue
        want = scalars[0]
        ok = (isinstance(value, bool) == (want is bool)
              and isinstance(value, (int, float) if want is float else want))
        if not ok:
            raise ValueError(f"{name}: expected {SCALARS[want]}, got {value!r}")


def load_yaml(path: str | Path, overrides: dict[str, Any] | None = None) -> DeploymentConfig:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a deployment file is a mapping of keys to values")
    return from_mapping(data, overrides)
