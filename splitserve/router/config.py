"""The router's frozen configuration, validated on construction. No secrets live here."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.vocab import Pool
from splitserve.routing import DEFAULT_POLICY, CacheWeights, policy_names
from splitserve.routing.prefix import LOCAL_PREFILL_MAX_TOKENS

# the policy names each pool accepts: the registry's (`splitserve.routing.POLICIES`)
PREFILL_POLICIES: tuple[str, ...] = policy_names(Pool.PREFILL)
DECODE_POLICIES: tuple[str, ...] = policy_names(Pool.DECODE)
UNSPLITTABLE_MODES: tuple[str, ...] = ("whole", "refuse")


def _check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which workers it starts with, and how it chooses among them.

    `unsplittable` says what happens to a request whose parameters the seeded two-leg flow cannot
    honour exactly (see `params.unsplittable_reason`): `whole` runs it unsplit on one worker (a
    colocated one if any, else a decode worker: exact, at the cost of TTFT), `refuse` answers 400
    naming the parameter.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()  # the other routers over the same workers (`router.peers`)
    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: str | None = None  # tokenizer for chat templates; default: the workers' model root
    prefill_policy: str = DEFAULT_POLICY
    decode_policy: str = DEFAULT_POLICY
    # `cache`'s weights: a cached token against a queued one (P); a whole prompt cached
    # against `load`'s score (D) — see `routing.CacheWeights`
    prefill_hit_weight: float = 1.0
    decode_hit_weight: float = 1.0
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # 0: never prefill on D
    unsplittable: str = "whole"
    kv_transport: str | None = None  # per-transfer transport; None: what D advertises
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 3  # consecutive failed checks or requests before a worker leaves
    healthy_after: int = 2  # consecutive good checks before it returns
    prefill_retries: int = 2  # extra attempts on another P before t1
    whole_retries: int = 2  # unsplit requests: extra attempts on another worker before a byte
    decode_retries: int = 2  # resumptions on another D (recomputing what was already produced)
    retry_backoff_s: float = 0.05
    retry_backoff_max_s: float = 2.0
    request_timeout_s: float = 1800.0
    connect_timeout_s: float = 5.0
    max_inflight: int = 4096  # admission: more concurrent requests than this get 429 at once
    max_inflight_per_worker: int = 256  # queue limit: open legs on one worker; beyond it, 429
    max_body_bytes: int = 16 * 1024**2  # larger request bodies get 413 before they are read
    body_timeout_s: float = 30.0  # a request body not received within this gets 408
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish

    def __post_init__(self) -> None:
        for url in (*self.prefill, *self.decode, *self.colocated):
            _check_url(url)
        for url in self.peers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"peer router URL must start with http:// or https://, "
                                 f"got {url!r}")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("a disaggregated deployment needs at least one prefill and one "
                             "decode worker")
        if not (self.prefill or self.colocated):
            raise ValueError("the router needs workers: --prefill and --decode, or --colocated")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be a TCP port, got {self.port}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy must be one of {PREFILL_POLICIES}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_policy must be one of {DECODE_POLICIES}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must not be negative (0 turns it off)")
        CacheWeights(self.prefill_hit_weight, self.decode_hit_weight)  # validates them
        if self.kv_transport not in (None, "tcp", "shm"):
            raise ValueError("kv_transport must be tcp, shm or unset")
        if self.unsplittable not in UNSPLITTABLE_MODES:
            raise ValueError(f"unsplittable must be one of {UNSPLITTABLE_MODES}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s",
                     "connect_timeout_s", "drain_timeout_s", "retry_backoff_max_s",
                     "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("unhealthy_after", "healthy_after", "max_inflight",
                     "max_inflight_per_worker", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if min(self.prefill_retries, self.decode_retries, self.whole_retries,
               self.retry_backoff_s) < 0:
            raise ValueError("retries and backoff must not be negative")

    @property
    def cache_weights(self) -> CacheWeights:
        return CacheWeights(prefill_hit=self.prefill_hit_weight,
                            decode_hit=self.decode_hit_weight)
