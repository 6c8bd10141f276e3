"""How the router drives each connector's two legs: the `LegProtocol` interface and contract
(`base`), and one implementation per connector (`splitserve`, `nixl`, `mooncake`)."""

from __future__ import annotations

import aiohttp

from splitserve.router.legs.base import (
    DecodeStart,
    Getter,
    LegProtocol,
    LegProtocols,
    Transfer,
    advertised_endpoint,
    drop_replayed,
)
from splitserve.router.legs.mooncake import MooncakeLegs
from splitserve.router.legs.nixl import NixlLegs
from splitserve.router.legs.splitserve import SplitserveLegs, push_target

__all__ = ["DecodeStart", "LegProtocol", "LegProtocols", "MooncakeLegs", "NixlLegs",
           "SplitserveLegs", "Getter", "Transfer", "advertised_endpoint", "drop_replayed",
           "leg_protocols", "push_target"]


def leg_protocols(session: aiohttp.ClientSession, token: str | None,
                  transport: str | None = None) -> LegProtocols:
    """Every connector the router drives, over the app's one session to workers."""
    return LegProtocols(SplitserveLegs(session, token, transport), NixlLegs(),
                        MooncakeLegs(session))
