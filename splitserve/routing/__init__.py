"""Routing policies as pluggable parts, shared by the router and the simulator (neither is
imported here): `view` (what a policy may read) and `policies` (the policies, by pool and name).
"""

from __future__ import annotations

from splitserve.routing.policies import (
    DEFAULT_POLICY,
    POLICIES,
    Policy,
    PolicyFactory,
    decode_score,
    fits_staging,
    make_policy,
    policy_names,
    prefill_score,
)
from splitserve.routing.view import NO_REQUEST, Draws, RandomDraws, RouteRequest, WorkerView

__all__ = ["DEFAULT_POLICY", "NO_REQUEST", "POLICIES", "Draws", "Policy", "PolicyFactory",
           "RandomDraws", "RouteRequest", "WorkerView", "decode_score", "fits_staging",
           "make_policy", "policy_names", "prefill_score"]
