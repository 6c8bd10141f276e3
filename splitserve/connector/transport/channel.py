"""The channel interface P's send bookkeeping drives: the transport swap point as
`prefill_send.PrefillSends` sees it."""

from __future__ import annotations

from typing import Protocol

from splitserve.connector.transport.items import LayerItem, SendState


class TransferChannel(Protocol):
    """What P's send bookkeeping (`prefill_send.PrefillSends`) calls on a channel to one D, all
    on the engine's worker thread. `PushChannel` implements it over a socket; the unit tests'
    fake (tests/support/channels.py) in memory."""

    def begin(self, transfer_id: str, num_tokens: int, nbytes: int, ack_timeout_s: float,
              skip: int = 0) -> SendState:
        """Open a transfer of the prompt tokens [skip, num_tokens), `nbytes` in all."""
        ...

    def push_layer(self, item: LayerItem) -> None: ...

    def end(self, transfer_id: str) -> None: ...

    def cancel(self, transfer_id: str) -> None: ...

    def poll(self, transfer_id: str) -> SendState | None: ...

    def forget(self, transfer_id: str) -> None: ...

    @property
    def connected(self) -> bool:
        """Whether the channel holds a live connection to D (False before its first connect
        and once the connection was lost: a D that died or dropped it)."""
        ...

    def close(self) -> None: ...
