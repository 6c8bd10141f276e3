"""How the router drives each connector's two legs: the `LegProtocol` interface and contract
(`base`), and one implementation per connector (`splitserve`, `nixl`)."""

from __future__ import annotations

import aiohttp

from splitserve.router.legs.base import (
    DecodeStart,
    LegProtocol,
    LegProtocols,
    Transfer,
    connector_of,
    drop_replayed,
)
from splitserve.router.legs.nixl import NixlLegs
from splitserve.router.legs.splitserve import SplitserveLegs

__all__ = ["DecodeStart", "LegProtocol", "LegProtocols", "NixlLegs", "SplitserveLegs",
           "Transfer", "connector_of", "drop_replayed", "leg_protocols"]


def leg_protocols(session: aiohttp.ClientSession, token: str | None,
                  transport: str | None = None) -> LegProtocols:
    """Every connector the router drives, over the app's one session to workers."""
    return LegProtocols(SplitserveLegs(session, token, transport), NixlLegs())
