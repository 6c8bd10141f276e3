"""What flows through P's channel to one D: a transfer's state (`SendState`) and the items
queued for its sender thread (`QueueItem`, dispatched by type): a transfer to begin
(`BeginItem`), its layers — still in P's blocks (`LayerItem`), copied by the forward thread
into a buffer whose frame waits to be sent (`ReadyLayer`), or queued on the copier and not yet
complete (`CopiedLayer`) — its END (`EndItem`), and an ABORT of one P gave up on
(`AbortItem`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from splitserve.common.vocab import TransferStatus
from splitserve.connector.devcopy import DONE, Completion
from splitserve.connector.layout.paged import PagedLayout
from splitserve.connector.messages import Layer
from splitserve.connector.stats import TransferRecord

log = logging.getLogger(__name__)


@dataclass
class SendState:
    """One transfer on P's channel. `status`: `open` until settled, then `complete` (D
    acknowledged it, verified), `failed` or `cancelled`."""

    transfer_id: str
    num_tokens: int  # the prompt's length
    record: TransferRecord
    deadline: float  # no ACK by then -> failed (`ack_timeout_s` after BEGIN, then after END)
    skip: int = 0  # the first token sent: D's prefix cache is to hold [0, skip)
    ack_timeout_s: float = 30.0
    status: TransferStatus = TransferStatus.OPEN
    offset: int = -1  # D's staging offset (from BEGIN_OK)
    began: threading.Event = field(default_factory=threading.Event)
    # LAYER frames whose payload is already in D's staging, held back so that D wakes once per
    # transfer; appended before END is queued, they go out with END, or are dropped on abort
    unsent: list[bytes] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        return self.status != TransferStatus.OPEN


@dataclass(frozen=True)
class LayerItem:
    """One layer's KV for tokens [start, end), still in P's paged blocks (held until settled)."""

    transfer_id: str
    layer: int
    start: int
    end: int
    layout: PagedLayout  # the layer's cache
    block_ids: tuple[int, ...]
    ready: Completion = DONE  # complete once the layer's KV is written (`Copier.mark`)

    def gather_into(self, region: torch.Tensor) -> None:
        """Off the forward thread: once the layer's KV is written, copy this chunk's staging
        bytes (uint8, exactly its tokens) into `region`; returns when it holds them."""
        self.ready.wait()
        self.layout.gather(self.block_ids, self.start, self.end, region)

    def frame(self, payload: memoryview, inline: bool = True, written_s: float | None = None,
              corrupt: bool = False) -> Layer:
        """The LAYER message for this chunk's `payload`, with its xxh3 checksum (`corrupt`: one
        bit of it flipped, for fault tests)."""
        digest = xxhash.xxh3_64_hexdigest(payload)
        if corrupt:
            digest = format(int(digest, 16) ^ 1, "016x")
        return Layer(self.transfer_id, self.layer, self.start, self.end, len(payload), digest,
                     inline, written_s)


@dataclass(frozen=True)
class CopiedLayer:
    """A layer whose copy into `region` the forward thread queued on the copier (`done` not yet
    complete): the sender waits for it, then checksums and sends (or holds) the frame;
    `release` returns the region's buffer once sent or dropped."""

    item: LayerItem
    region: torch.Tensor
    done: Completion
    release: Callable[[], None]

    @property
    def transfer_id(self) -> str:
        return self.item.transfer_id

    def settle(self, release: bool = True) -> bool:
        """Wait for the copy; whether it completed (a device error fails its transfer). The
        buffer is released here if the copy failed, or if `release`."""
        try:
            self.done.wait()
        except Exception:
            log.exception("KV copy of transfer %s failed", self.transfer_id)
            self.release()
            return False
        if release:
            self.release()
        return True


@dataclass(frozen=True)
class ReadyLayer:
    """A layer already copied out of P's blocks: `parts` (frame, payload) wait for the sender;
    `release` returns the payload's buffer once sent or dropped."""

    transfer_id: str
    parts: list[bytes | memoryview]
    release: Callable[[], None]


@dataclass(frozen=True)
class BeginItem:
    """Send BEGIN for a transfer and wait (up to the begin timeout) for D's answer."""

    state: SendState

    @property
    def transfer_id(self) -> str:
        return self.state.transfer_id


@dataclass(frozen=True)
class EndItem:
    """Send END (with every LAYER frame held back) once the transfer's last layer is queued."""

    transfer_id: str


@dataclass(frozen=True)
class AbortItem:
    """Send ABORT for a transfer P gave up on, so D frees its region."""

    transfer_id: str


QueueItem = BeginItem | LayerItem | ReadyLayer | CopiedLayer | EndItem | AbortItem
