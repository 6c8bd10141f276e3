"""What flows through P's channel to one D: a transfer's state (`SendState`) and the layers
queued for its sender thread — still in P's blocks (`LayerItem`), copied by the forward thread
into a buffer whose frame waits to be sent (`ReadyLayer`), or queued on the copier and not yet
complete (`CopiedLayer`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.connector.devcopy import DONE, Completion
from splitserve.connector.layout.paged import PagedLayout
from splitserve.connector.stats import TransferRecord


@dataclass
class SendState:
    transfer_id: str
    num_tokens: int
    record: TransferRecord
    deadline: float  # no ACK by then -> failed
    status: str = "pending"  # pending | acked | failed | cancelled
    offset: int = -1  # D's staging offset (from BEGIN_OK)
    began: threading.Event = field(default_factory=threading.Event)
    # LAYER frames whose payload is already in D's staging, held back so that D wakes once per
    # transfer; appended before END is queued, they go out with END, or are dropped on abort
    unsent: list[bytes] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        return self.status != "pending"


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


@dataclass(frozen=True)
class ReadyLayer:
    """A layer already copied out of P's blocks: `parts` (frame, payload) wait for the sender;
    `release` returns the payload's buffer once sent or dropped."""

    transfer_id: str
    parts: list[bytes | memoryview]
    release: Callable[[], None]
