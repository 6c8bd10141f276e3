"""Routing policies as pluggable parts, shared by the router and the simulator (neither is
imported here): `view` (what a policy may read) and `policies` (the policies, by pool and name).
"""

from __future__ import annotations

from splitserve.routing.policies import (
    COLOCATED_POLICY,
    DEFAULT_POLICY,
    POLICIES,
    CacheWeights,
    Policy,
    PolicyFactory,
    decode_score,
    fits_staging,
    make_policy,
    policy_names,
    prefill_cost,
    prefill_score,
)
from splitserve.routing.view import NO_REQUEST, Draws, RandomDraws, RouteRequest, WorkerView

__all__ = ["COLOCATED_POLICY", "DEFAULT_POLICY", "NO_REQUEST", "POLICIES", "CacheWeights",
           "Draws", "Policy", "PolicyFactory", "RandomDraws", "RouteRequest", "WorkerView",
           "decode_score", "fits_staging", "make_policy", "policy_names", "prefill_cost",
           "prefill_score"]
