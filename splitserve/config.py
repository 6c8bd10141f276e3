"""Frozen configuration for splitserve's parts, validated on construction.

Secrets never live here: the deployment token reaches processes through `SPLITSERVE_TOKEN` or a
file named by `SPLITSERVE_TOKEN_FILE` (see `load_token`), never a command line or vLLM's logged
`--kv-transfer-config`.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from splitserve.common import speculative
from splitserve.common.vocab import Connector, Role, values

Transport = Literal["tcp", "shm"]
FailurePolicy = Literal["recompute", "fail"]

TRANSPORTS: tuple[str, ...] = ("tcp", "shm")
FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")
# The NIXL progress thread's poll timeout: nixl's Python API hard-codes 0 (a busy spin).
NIXL_PROGRESS_DELAY_US = 10_000
# How long a worker's step queues busy-poll after a read before they block (`worker.spin`;
# vLLM: 1 s, each such second taking a core the worker shares). Measured here without a stall at
# 0.1 s; at 0 readers missed wake-ups and stalled for vLLM's 5 s recheck; nothing below 0.1 s
# has been measured, so nothing below it is allowed.
IDLE_SPIN_S = 0.1
MIN_IDLE_SPIN_S = 0.1
VLLM_PINNED_VERSION = "0.32.0"
TOKEN_ENV = "SPLITSERVE_TOKEN"
TOKEN_FILE_ENV = "SPLITSERVE_TOKEN_FILE"
FAULTS_ENV = "SPLITSERVE_FAULTS"


E = TypeVar("E", Role, Connector)
KV_EVENTS_FLAG = "--kv-events-config"
KV_MEMORY_FLAG = "--kv-cache-memory-bytes"


def check_idle_spin(spin_s: float, name: str) -> float:
    """`spin_s` if it is a busy-poll window splitserve allows (at least `MIN_IDLE_SPIN_S`);
    ValueError naming `name` otherwise."""
    if not spin_s >= MIN_IDLE_SPIN_S:
        raise ValueError(f"{name} must be at least {MIN_IDLE_SPIN_S} s, got {spin_s!r}: at 0 "
                         "vLLM's step queues missed wake-ups and stalled steps for up to 5 s, "
                         "and shorter windows are not measured")
    return spin_s


def check_kv_events_passthrough(args: tuple[str, ...] | list[str], kv_events: bool) -> None:
    """A worker that reports its cache configures vLLM's KV events itself (a private socket its
    relay reads): refuse the user's own `--kv-events-config` (or an abbreviation vLLM's argparse
    would expand to it) among the arguments passed to vLLM, naming `--no-kv-events`."""
    if not kv_events:
        return
    for arg in args:
        flag = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if flag.startswith("--kv-e") and KV_EVENTS_FLAG.startswith(flag):
            raise ValueError(
                f"{arg.split('=', 1)[0]}: splitserve configures vLLM's KV cache events itself "
                "(published on a private socket that the worker relays to routers, behind the "
                "deployment token); to publish them your own way, turn splitserve's off with "
                "--no-kv-events (YAML: kv_events: false)")


def check_kv_memory_passthrough(args: tuple[str, ...] | list[str]) -> None:
    """vLLM's CPU build sizes the KV cache from `VLLM_CPU_KVCACHE_SPACE` over any
    `--kv-cache-memory-bytes` (`platforms/cpu.py`), and splitserve sets that variable from
    `--kv-cache-gib`: refuse the flag (or an abbreviation of it) among the arguments passed to
    vLLM, which would be ignored, naming `--kv-cache-gib`."""
    for arg in args:
        flag = arg.split("=", 1)[0].replace("_", "-")
        if flag.startswith("--kv-cache-mem") and KV_MEMORY_FLAG.startswith(flag):
            raise ValueError(
                f"{arg.split('=', 1)[0]}: vLLM's CPU build sizes the KV cache from "
                "VLLM_CPU_KVCACHE_SPACE, which splitserve sets: give --kv-cache-gib instead "
                "(YAML: kv_cache_gib; GiB per engine rank)")


def as_member(enum: type[E], value: Any, name: str, or_else: str = "") -> E:
    """`value` as a member of `enum`; ValueError naming the choices otherwise."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {values(enum)}{or_else}, got {value!r}"
                         ) from None


def _check_port(name: str, port: int, allow_zero: bool = False) -> None:
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port, got {port}")


def check_tls_files(cert: str | None, key: str | None, ca: str | None, prefix: str = "tls_",
                    must_exist: bool = True) -> None:
    """TLS for the KV channel: certificate and key together (the listener presents them), the CA
    only with them, and (`must_exist`) every named file exists here."""
    if (cert is None) != (key is None):
        raise ValueError(f"{prefix}cert and {prefix}key go together")
    if ca is not None and cert is None:
        raise ValueError(f"{prefix}ca needs {prefix}cert and {prefix}key (every worker's "
                         "listener presents a certificate)")
    for name, path in (("cert", cert), ("key", key), ("ca", ca)):
        if must_exist and path is not None and not Path(path).is_file():
            raise ValueError(f"{prefix}{name}: no such file {path!r}")


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, carried in `kv_connector_extra_config` (no secrets)."""

    role: Role = Role.BOTH
    transport: Transport = "tcp"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    # D: bytes of KV that may be staged (received, not yet claimed by a decode request).
    staging_bytes: int = 512 * 1024**2
    # D: staged KV not claimed by a decode request within this time is freed.
    lease_s: float = 60.0
    # D: a decode request whose transfer is not complete within this time is a load error.
    load_timeout_s: float = 30.0
    # P: blocks are freed when D acknowledges, or after this time without an acknowledgement.
    ack_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    # TLS (file paths, never key material): when set, the listener's port speaks only TLS
    # (pushes over either transport and control queries), and this worker's clients use it.
    tls_cert: str | None = None  # PEM certificate (chain) the listener presents
    tls_key: str | None = None  # its private key
    tls_ca: str | None = None  # verifies peers (and makes TLS mutual); None: the system's CAs

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", as_member(Role, self.role, "role"))
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        _check_port("kv_port", self.kv_port, allow_zero=True)
        if self.staging_bytes < 1024**2:
            raise ValueError("staging_bytes must be at least 1 MiB")
        for name in ("lease_s", "load_timeout_s", "ack_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        check_tls_files(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None

    def to_extra_config(self) -> dict[str, Any]:
        return {Connector.SPLITSERVE.value: {**asdict(self), "role": self.role.value}}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorConfig:
        return cls(**extra.get(Connector.SPLITSERVE.value, {}))


@dataclass(frozen=True)
class WorkerConfig:
    """One vLLM worker. `role=None` is plain vLLM with no connector (the baseline)."""

    model: str
    port: int
    role: Role | None = None
    host: str = "127.0.0.1"
    cpus: tuple[int, ...] | None = None
    # splitserve: the connector's listener; nixl: NIXL's side channel (its handshake port)
    kv_port: int = 0
    connector: Connector = Connector.SPLITSERVE
    transport: Transport = "tcp"
    on_transfer_failure: FailurePolicy = "recompute"
    dtype: str = "float32"
    kv_cache_gib: int = 1
    max_model_len: int | None = None  # None: the model's own length, as vLLM derives it
    max_num_batched_tokens: int | None = None
    served_model_name: str | None = None
    staging_bytes: int = 512 * 1024**2
    load_timeout_s: float = 30.0
    lease_s: float = 60.0
    # nixl: the progress thread's poll timeout in microseconds (0: vLLM's busy spin)
    nixl_progress_delay_us: int = NIXL_PROGRESS_DELAY_US
    # nixl: the forward thread keeps `cpus` (False: vLLM moves it to the last core per NUMA node)
    nixl_keep_affinity: bool = True
    # mooncake: the transfer engine's protocol, tcp or rdma (None: rdma where an RDMA device is)
    mooncake_protocol: str | None = None
    shutdown_timeout_s: int = 30  # SIGTERM: finish in-flight requests for up to this long
    kv_tls_cert: str | None = None  # TLS on the KV channel (see ConnectorConfig)
    kv_tls_key: str | None = None
    kv_tls_ca: str | None = None
    # publish the engine's KV cache events to the worker's relay (`worker.kvrelay`), which
    # serves them to routers; needs the deployment token (a worker without one never reports)
    kv_events: bool = True
    # vLLM's --speculative-config (JSON): drafting on D or colocated (`common.speculative`)
    speculative_config: str | None = None
    # tensor parallelism: ranks of one engine, each on its share of `cpus` (`rank_cpus`)
    tensor_parallel_size: int = 1
    # how long the engine's step queues busy-poll after a message before they block
    # (`worker.spin`); None: vLLM's own 1 s, which takes a shared core for a second a step
    idle_spin_s: float | None = IDLE_SPIN_S
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_kv_events_passthrough(self.extra_args, self.kv_events)
        check_kv_memory_passthrough(self.extra_args)
        if self.role is not None:
            object.__setattr__(self, "role", as_member(Role, self.role, "role", " or None"))
        flag = speculative.passthrough_flag(self.extra_args)
        if self.speculative_config is not None:
            if flag is not None:
                raise ValueError(f"{flag} after `--` and speculative_config both given: "
                                 "give it once")
            object.__setattr__(self, "speculative_config",
                               speculative.canonical(self.speculative_config))
            speculative.check_for_role(self.speculative_config, self.role)
        elif flag is not None and self.role == Role.PREFILL:
            raise ValueError(speculative.NOT_ON_P)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        object.__setattr__(self, "connector", as_member(Connector, self.connector, "connector"))
        check_tensor_parallel(self.tensor_parallel_size, self.extra_args)
        if self.nixl_progress_delay_us < 0:
            raise ValueError("nixl_progress_delay_us must not be negative")
        if self.idle_spin_s is not None:  # None: vLLM's own
            check_idle_spin(self.idle_spin_s, "idle_spin_s (or None: vLLM's own)")
        if self.on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}")
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16 or auto, got {self.dtype!r}")
        _check_port("port", self.port)
        _check_port("kv_port", self.kv_port, allow_zero=True)
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"cpus must be a non-empty list of core ids, got {self.cpus}")
        if self.kv_cache_gib < 1:
            raise ValueError("kv_cache_gib must be a whole number of GiB, at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be positive (omit it for the model's own)")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must not be negative (0: abort in-flight)")
        if self.role is not None and self.kv_port == 0:
            raise ValueError("a worker with a connector needs kv_port (the launcher picks one)")
        check_tls_files(self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca, prefix="kv_tls_")
        if self.role is None and self.kv_tls_cert is not None:
            raise ValueError("kv TLS is for the connector's channel; a plain worker has none")
        if self.connector == Connector.NIXL and self.kv_tls_cert is not None:
            raise ValueError("kv TLS is splitserve's connector's; NIXL's side channel and UCX "
                             "transfers are not encrypted (keep them on a trusted network)")
        if self.connector == Connector.MOONCAKE and self.kv_tls_cert is not None:
            raise ValueError("kv TLS is splitserve's connector's; Mooncake's bootstrap server "
                             "and transfers are not encrypted (keep them on a trusted network)")
        if self.mooncake_protocol not in (None, "tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be tcp or rdma, "
                             f"got {self.mooncake_protocol!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def rank_cpus(self, cores: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """`cores` split across the TP ranks: contiguous runs, as even as the count allows
        (the first ranks get one more). With fewer cores than ranks, rank r shares core
        `cores[r % len(cores)]`: the ranks stay on this worker's cores, slowed but not
        spread onto another worker's."""
        tp = self.tensor_parallel_size
        if len(cores) < tp:
            return tuple((cores[r % len(cores)],) for r in range(tp))
        return split_evenly(cores, tp)

    def connector_config(self) -> ConnectorConfig:
        assert self.role is not None
        return ConnectorConfig(
            role=self.role, transport=self.transport, kv_host=self.host, kv_port=self.kv_port,
            staging_bytes=self.staging_bytes, load_timeout_s=self.load_timeout_s,
            lease_s=self.lease_s, ack_timeout_s=self.load_timeout_s,
            tls_cert=self.kv_tls_cert, tls_key=self.kv_tls_key, tls_ca=self.kv_tls_ca,
        )


TP_FLAGS = ("--tensor-parallel-size", "-tp")


def check_tensor_parallel(tp: int, extra_args: tuple[str, ...]) -> None:
    """Refuse a TP degree a worker cannot run: below 1, or given to vLLM after `--` (the
    ranks' cores are splitserve's to split; more ranks than cores share them). Whether the
    model's heads shard over `tp` is vLLM's to say at start-up."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {tp}")
    if any(a.split("=", 1)[0] in TP_FLAGS for a in extra_args):
        raise ValueError("give the tensor-parallel degree as --tp N (serve: --prefill-tp, "
                         "--decode-tp, --colocated-tp), not after `--`: splitserve splits the "
                         "worker's cores across its ranks")


def split_evenly(cores: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    """`cores` as `parts` contiguous runs, as even as the count allows (the first runs get one
    more); ValueError when there are fewer cores than parts."""
    if len(cores) < parts:
        raise ValueError(f"{parts} ranks need at least {parts} cores, got {len(cores)}")
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(tuple(cores[start:end]))
        start = end
    return tuple(out)


def load_token(required: bool = True) -> str | None:
    """The deployment token from `SPLITSERVE_TOKEN` or the file named by `SPLITSERVE_TOKEN_FILE`.
    ValueError, in one line, when that file cannot be read or a `required` token is missing."""
    token = os.environ.get(TOKEN_ENV)
    if not token and os.environ.get(TOKEN_FILE_ENV):
        try:
            token = Path(os.environ[TOKEN_FILE_ENV]).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{TOKEN_FILE_ENV}: cannot read the deployment token: {exc}"
                             ) from None
    if not token and required:
        raise ValueError(
            f"no deployment token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
            "(`splitserve serve` generates one per deployment)"
        )
    return token or None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def bearer_headers(secret: str | None) -> dict[str, str]:
    """`Authorization: Bearer <secret>`, or nothing without a secret: how every client of a
    worker (the deployment token) or of the router (its API key) authenticates."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}
