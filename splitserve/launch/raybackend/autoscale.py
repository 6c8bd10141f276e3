"""Each pool's Ray Serve autoscaling policy, on its own signal.

Ray Serve's built-in policy counts requests that pass through Serve's handles; splitserve's
traffic goes from the router to the workers directly, so each replica reports its own signals
from `record_autoscaling_stats()` and these policies turn them into a replica count:

- P (`PrefillPolicy`): `queued_prompt_tokens`, the prompt tokens of the prefill legs the router
  has open on the replica (admitted, first token not yet returned): what TTFT waits behind.
- D (`DecodePolicy`): `running` (vLLM's running requests) and `kv_usage` (vLLM's KV cache
  usage, 0-1): what ITL and admission depend on.

Both are per-deployment policies (`AutoscalingConfig.policy`), chosen over an application-level
policy (which Ray's schema marks unsupported, and which would tie the pools' decisions together
when their signals are independent) and over `external_scaler_enabled` (which would make
splitserve run its own control loop). Serve applies each pool's min/max and its
upscale/downscale delays around these functions.

Contract of `step` (the one rule both policies share):
- while a change is in progress (running replicas != the current target) the target holds:
  a slow start never triggers a second step;
- otherwise the target moves by at most one replica: up when the pool needs more than it has,
  down when the load would fit in one replica fewer at `downscale_below` of its capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

PREFILL_SIGNAL = "queued_prompt_tokens"
DECODE_SIGNALS = ("running", "kv_usage")


def step(current: int, target: int, needed: float, downscale_below: float) -> int:
    """The next target replica count; `needed` is the load in replicas' worth of capacity."""
    if current != target:
        return target
    if needed > current:
        return current + 1
    if current > 1 and needed < (current - 1) * downscale_below:
        return current - 1
    return current


def total(metrics: Mapping[str, Mapping[Any, float]] | None, name: str) -> float:
    """A signal summed over the replicas that report it (each already averaged by Serve over
    its look-back window)."""
    values = (metrics or {}).get(name) or {}
    return float(sum(v for v in values.values() if isinstance(v, int | float)
                     and math.isfinite(v)))


class PrefillPolicy:
    """P: replicas needed = queued prompt tokens / `queued_tokens` per replica."""

    def __init__(self, queued_tokens: float, downscale_below: float) -> None:
        self.queued_tokens = queued_tokens
        self.downscale_below = downscale_below

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        needed = total(ctx.aggregated_metrics, PREFILL_SIGNAL) / self.queued_tokens
        target = step(ctx.current_num_replicas, ctx.target_num_replicas, needed,
                      self.downscale_below)
        return target, {"needed": needed}


class DecodePolicy:
    """D: replicas needed = the larger of running requests / `running` per replica and KV
    usage / `kv_usage` per replica."""

    def __init__(self, running: float, kv_usage: float, downscale_below: float) -> None:
        self.running = running
        self.kv_usage = kv_usage
        self.downscale_below = downscale_below

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics
        needed = max(total(metrics, "running") / self.running,
                     total(metrics, "kv_usage") / self.kv_usage)
        target = step(ctx.current_num_replicas, ctx.target_num_replicas, needed,
                      self.downscale_below)
        return target, {"needed": needed}


def autoscaling_config(kind: str, bounds: tuple[int, int], opts: Any) -> dict[str, Any] | None:
    """The Serve `autoscaling_config` of a pool, or None for a pool of fixed size."""
    low, high = bounds
    if low == high or kind == "colocated":
        return None
    if kind == "prefill":
        policy = {"policy_function": f"{__name__}:PrefillPolicy",
                  "policy_kwargs": {"queued_tokens": opts.prefill_queued_tokens,
                                    "downscale_below": opts.downscale_below}}
    else:
        policy = {"policy_function": f"{__name__}:DecodePolicy",
                  "policy_kwargs": {"running": opts.decode_running,
                                    "kv_usage": opts.decode_kv_usage,
                                    "downscale_below": opts.downscale_below}}
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": low,
            "upscale_delay_s": opts.upscale_delay_s,
            "downscale_delay_s": opts.downscale_delay_s,
            "look_back_period_s": opts.look_back_period_s, "policy": policy}
