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
  a slow start never triggers a second step; but a change still in progress after `hold_s`
  (the deployment's `startup_timeout_s`: e.g. a replica no node can place) is given up, the
  target set back to the replicas running, so the pool scales on again;
- otherwise the target moves by at most one replica: up when the pool needs more than it has,
  down when the load would fit in one replica fewer at `downscale_below` of its capacity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

PREFILL_SIGNAL = "queued_prompt_tokens"
DECODE_SIGNALS = ("running", "kv_usage")


def step(current: int, target: int, needed: float, downscale_below: float,
         held_s: float = 0.0, hold_s: float = math.inf) -> int:
    """The next target replica count; `needed` is the load in replicas' worth of capacity;
    `held_s`: how long the change in progress (if any) has been."""
    if current != target:
        return target if held_s < hold_s else current
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


def decide(ctx: Any, needed: float, downscale_below: float, hold_s: float
           ) -> tuple[int, dict[str, Any]]:
    """`step` on Serve's context; the policy state keeps when the change in progress began."""
    current, target = ctx.current_num_replicas, ctx.target_num_replicas
    now = time.monotonic()
    since = (ctx.policy_state or {}).get("changing_since")
    if current == target or since is None:
        since = now
    decided = step(current, target, needed, downscale_below, now - since, hold_s)
    return decided, {"needed": needed, "changing_since": since if current != target else None}


class PrefillPolicy:
    """P: replicas needed = queued prompt tokens / `queued_tokens` per replica."""

    def __init__(self, queued_tokens: float, downscale_below: float,
                 hold_s: float = math.inf) -> None:
        self.queued_tokens = queued_tokens
        self.downscale_below = downscale_below
        self.hold_s = hold_s

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        needed = total(ctx.aggregated_metrics, PREFILL_SIGNAL) / self.queued_tokens
        return decide(ctx, needed, self.downscale_below, self.hold_s)


class DecodePolicy:
    """D: replicas needed = the larger of running requests / `running` per replica and KV
    usage / `kv_usage` per replica."""

    def __init__(self, running: float, kv_usage: float, downscale_below: float,
                 hold_s: float = math.inf) -> None:
        self.running = running
        self.kv_usage = kv_usage
        self.downscale_below = downscale_below
        self.hold_s = hold_s

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics
        needed = max(total(metrics, "running") / self.running,
                     total(metrics, "kv_usage") / self.kv_usage)
        return decide(ctx, needed, self.downscale_below, self.hold_s)


def autoscaling_config(kind: str, bounds: tuple[int, int], opts: Any,
                       hold_s: float = math.inf) -> dict[str, Any] | None:
    """The Serve `autoscaling_config` of a pool, or None for a pool of fixed size; `hold_s`:
    how long a change may stay in progress (see `step`)."""
    low, high = bounds
    if low == high or kind == "colocated":
        return None
    if kind == "prefill":
        policy = {"policy_function": f"{__name__}:PrefillPolicy",
                  "policy_kwargs": {"queued_tokens": opts.prefill_queued_tokens,
                                    "downscale_below": opts.downscale_below,
                                    "hold_s": hold_s}}
    else:
        policy = {"policy_function": f"{__name__}:DecodePolicy",
                  "policy_kwargs": {"running": opts.decode_running,
                                    "kv_usage": opts.decode_kv_usage,
                                    "downscale_below": opts.downscale_below,
                                    "hold_s": hold_s}}
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": low,
            "upscale_delay_s": opts.upscale_delay_s,
            "downscale_delay_s": opts.downscale_delay_s,
            "look_back_period_s": opts.look_back_period_s, "policy": policy}
