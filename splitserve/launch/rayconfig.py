"""The Ray backend's options: YAML `ray:` inside a deployment file, frozen and validated.

    backend: ray
    ray_address: 10.0.0.1:6379   # omit: a local Ray cluster is started for the deployment
    prefill: 2                   # each pool's starting (and minimum) replica count
    decode: 4
    ray:
      prefill_resources: {prefill: 1}   # custom resources each P replica needs (node placement)
      decode_resources: {decode: 1}
      router_resources: {router: 1}     # default: the router runs on the driver's node
      worker_cpus: 4                    # Ray CPUs per replica, and the cores it pins
      prefill_max: 4                    # > prefill: the P pool autoscales between the two
      decode_max: 8
      prefill_queued_tokens: 4096       # P's signal: queued prompt tokens per replica
      decode_running: 16                # D's signals: running requests per replica ...
      decode_kv_usage: 0.8              # ... and KV cache usage per replica (0-1)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

Resources = tuple[tuple[str, float], ...]
RESOURCE_KEYS = ("prefill_resources", "decode_resources", "colocated_resources",
                 "router_resources")


def as_resources(value: Any, key: str) -> Resources:
    if value is None:
        return ()
    if isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError(f"ray.{key} must be a mapping of resource names to amounts")
    out = []
    for name, amount in value.items():
        if not isinstance(name, str) or not isinstance(amount, int | float) or amount <= 0:
            raise ValueError(f"ray.{key}: {name!r} needs a positive amount, got {amount!r}")
        out.append((name, float(amount)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class RayOptions:
    """How pools are placed and scaled on Ray. Counts come from the deployment's
    `prefill`/`decode`/`colocated` (the minimum of each pool); `*_max` above them turns on
    Ray Serve autoscaling for that pool."""

    name: str = "splitserve"  # Serve application prefix and actor names
    namespace: str = "splitserve"
    prefill_resources: Resources = ()
    decode_resources: Resources = ()
    colocated_resources: Resources = ()
    router_resources: Resources = ()
    worker_cpus: int = 1
    max_replicas_per_node: int | None = None
    prefill_max: int | None = None
    decode_max: int | None = None
    prefill_queued_tokens: int = 4096
    decode_running: float = 16.0
    decode_kv_usage: float = 0.8
    downscale_below: float = 0.5  # step down when the load fits in n-1 replicas at this fraction
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 10.0
    look_back_period_s: float = 2.0
    metrics_push_interval_s: float = 0.5
    drain_timeout_s: float = 60.0  # a replica's drain before it stops
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        for key in RESOURCE_KEYS:
            object.__setattr__(self, key, as_resources(getattr(self, key), key))
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError("ray.name must be letters, digits, - and _")
        if self.worker_cpus < 1:
            raise ValueError("ray.worker_cpus must be at least 1")
        if self.max_replicas_per_node is not None and self.max_replicas_per_node < 1:
            raise ValueError("ray.max_replicas_per_node must be at least 1")
        for key in ("prefill_queued_tokens", "decode_running", "decode_kv_usage",
                    "look_back_period_s", "metrics_push_interval_s", "drain_timeout_s",
                    "health_check_period_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"ray.{key} must be positive")
        if not 0 < self.downscale_below < 1:
            raise ValueError("ray.downscale_below must be between 0 and 1")
        if self.decode_kv_usage > 1:
            raise ValueError("ray.decode_kv_usage is a fraction of the KV cache (0-1)")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("ray scaling delays must not be negative")

    def resources(self, kind: str) -> dict[str, float]:
        return dict(getattr(self, f"{kind}_resources"))

    def bounds(self, kind: str, minimum: int) -> tuple[int, int]:
        """(min, max) replicas of a pool; equal when it does not autoscale."""
        top = getattr(self, f"{kind}_max", None) if kind != "colocated" else None
        top = minimum if top is None else top
        if top < minimum:
            raise ValueError(f"ray.{kind}_max ({top}) is below the pool's size ({minimum})")
        return minimum, top


def ray_options(data: Any) -> RayOptions:
    if data is None:
        return RayOptions()
    if isinstance(data, RayOptions):
        return data
    if not isinstance(data, dict):
        raise ValueError("`ray:` must be a mapping")
    known = {f.name for f in fields(RayOptions)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown ray keys: {sorted(unknown)}")
    return RayOptions(**data)
