"""P's send bookkeeping (the worker process of a prefill worker).

After each layer, the layer's KV for the scheduled token range goes to the channel to the D
named in the request's transfer params, which copies it out of P's blocks on this thread once D
has opened the transfer (the sender thread before then, or for fault-marked transfers). P's
blocks stay held until the push is settled: a finished request is reported in
`finished_sending` only once its channel settled it (complete, failed or cancelled). The copies go
through the worker's `Copier` (`devcopy`): on a CUDA engine the forward thread only queues them
on a side stream, and the sender thread waits for each before it checksums and sends.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from splitserve.config import ConnectorConfig
from splitserve.connector.devcopy import Copier, InlineCopies
from splitserve.connector.faults import Faults
from splitserve.connector.layout.head_slice import HeadSlice
from splitserve.connector.layout.paged import PagedLayout
from splitserve.connector.layout.staging_format import KVShape
from splitserve.connector.meta import SaveSpec, SplitserveMeta
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.ranks import RankHeads
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.channel import TransferChannel
from splitserve.connector.transport.items import LayerItem, SendState
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel

# (host, port, transport) -> a channel to that D
OpenChannel = Callable[[str, int, str], TransferChannel]


@dataclass(frozen=True)
class _Piece:
    """What this rank pushes of one transfer to one D rank (`connector.ranks`)."""

    channel: TransferChannel
    state: SendState
    layouts: list[PagedLayout]  # each layer's cache, as the piece's heads


@dataclass
class _Send:
    pieces: list[_Piece]  # none: this rank holds no head it is the first to send
    ended: bool = False
    finished: bool = False  # vLLM finished the request; its blocks are held for us


class PrefillSends:
    """Every push this worker makes, one channel per (D host, port, transport), opened by
    `open_channel` (default: the tcp or shm `PushChannel`). Called on the engine's worker
    thread only.

    A channel that carries no transfer and has lost its connection (its D died, left or dropped
    it) is closed and forgotten with its buffers: in a pool whose Ds come and go, P keeps
    channels only to Ds it can reach. The next transfer to that address opens a new one (it
    would have had to connect again anyway).

    With tensor parallelism (`heads`, `connector.ranks`) each rank pushes the heads it is
    the first to hold to each D rank that holds them (D rank d at `port + d`), as one piece
    each; a rank that sends nothing reports its requests finished as soon as vLLM finishes
    them. A piece that is only part of this rank's heads is copied through `HeadSlice`,
    synchronously."""

    def __init__(self, cfg: ConnectorConfig, token: str, tls: ssl.SSLContext | None,
                 faults: Faults, stats: ConnectorStats, layers: dict[str, int],
                 layouts: list[PagedLayout], shape: KVShape, fingerprint: Fingerprint,
                 open_channel: OpenChannel | None = None, copier: Copier | None = None,
                 heads: RankHeads | None = None) -> None:
        self._cfg = cfg
        self._copier = copier or InlineCopies()
        self._token, self._tls, self._faults, self._stats = token, tls, faults, stats
        self._layers, self._layouts = layers, layouts
        self._shape, self._fingerprint = shape, fingerprint
        self._heads = heads or RankHeads.single(shape.num_kv_heads, shape.latent)
        self._open_channel = open_channel or self._push_channel
        self._channels: dict[tuple[str, int, str, int], TransferChannel] = {}
        self._sends: dict[str, _Send] = {}

    @property
    def held(self) -> int:
        """Requests whose blocks are held for a push not yet settled (or not yet reported)."""
        return len(self._sends)

    def _push_channel(self, host: str, port: int, transport: str, heads: int = 0
                      ) -> TransferChannel:
        """A channel carrying `heads` of this rank's heads (0: all of them)."""
        cls = ShmPushChannel if transport == "shm" else TcpPushChannel
        part = 0 < heads < self._shape.num_kv_heads
        return cls(host, port, self._token, self._fingerprint, self._stats, self._faults,
                   self._piece_shape(heads) if part else self._shape,
                   self._cfg.connect_timeout_s, self._cfg.ack_timeout_s, tls=self._tls,
                   copier=InlineCopies() if part else self._copier)

    def _piece_shape(self, heads: int) -> KVShape:
        """The staging shape of `heads` of this rank's heads."""
        return replace(self._shape, num_kv_heads=heads)

    def _channel(self, host: str, port: int, transport: str, heads: int) -> TransferChannel:
        key = (host, port, transport, heads)
        if key not in self._channels:
            self._channels[key] = (self._open_channel(host, port, transport) if
                                   heads == self._shape.num_kv_heads
                                   else self._push_channel(host, port, transport, heads))
        return self._channels[key]

    def open_sends(self, meta: SplitserveMeta) -> None:
        """Before the forward pass: BEGIN the pushes whose first chunk this step computes (D's
        answer then arrives while layer 0 computes, so every layer is copied straight into
        D's region on this thread)."""
        for spec in meta.saves:
            if spec.first and spec.request_id not in self._sends:
                self._open(spec)

    def _open(self, spec: SaveSpec) -> _Send:
        pieces = []
        for d, heads in self._heads.pieces_to(spec.decode_tp):
            lo, hi = self._heads.local(heads)
            ch = self._channel(spec.host, spec.port + d, spec.transport, hi - lo)
            staged_id = self._heads.of(d, spec.decode_tp).piece_id(spec.transfer_id, heads)
            nbytes = self._piece_shape(hi - lo).transfer_bytes(spec.prompt_len - spec.skip)
            state = ch.begin(staged_id, spec.prompt_len, nbytes, self._cfg.ack_timeout_s,
                             spec.skip)
            whole = hi - lo == self._shape.num_kv_heads
            layouts: list[PagedLayout] = (self._layouts if whole else
                                          [HeadSlice(la, lo, hi) for la in self._layouts])
            pieces.append(_Piece(ch, state, layouts))
        send = self._sends[spec.request_id] = _Send(pieces)
        return send

    def save_kv_layer(self, meta: SplitserveMeta, layer_name: str, kv_layer: torch.Tensor
                      ) -> None:
        layer = self._layers[layer_name]
        layout = self._layouts[layer]
        if not layout.holds(kv_layer):
            # on purpose not a per-transfer failure: every copy would read memory that is no
            # longer this layer's cache, so the engine must stop rather than serve
            raise RuntimeError(f"vLLM moved the KV cache of {layer_name} after registration")
        ready = self._copier.mark()  # what a copy made later, off this thread, waits for
        for spec in meta.saves:
            send = self._sends.get(spec.request_id)
            if send is None:
                if not spec.first:
                    continue  # its push was cancelled (preemption); nothing more to send
                send = self._open(spec)  # not opened before the forward pass
            if send.ended:
                continue
            for piece in send.pieces:
                piece.channel.push_layer(LayerItem(piece.state.transfer_id, layer, spec.start,
                                                   spec.end, piece.layouts[layer],
                                                   spec.block_ids, ready))

    def wait_for_save(self, meta: SplitserveMeta) -> None:
        for spec in meta.saves:
            send = self._sends.get(spec.request_id)
            if spec.last and send is not None and not send.ended:
                for piece in send.pieces:
                    piece.channel.end(piece.state.transfer_id)
                send.ended = True

    def handle_preemptions(self, meta: SplitserveMeta) -> None:
        for rid in meta.cancels:
            send = self._sends.get(rid)
            if send is not None and not send.ended:
                for piece in send.pieces:  # each returns once off the blocks
                    piece.channel.cancel(piece.state.transfer_id)
                send.ended = True

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Mark vLLM's newly finished requests; return those whose push has settled (their
        blocks may be freed now). A request finished before its last layer was aborted
        mid-prefill: its push is cancelled."""
        for rid in finished_req_ids:
            send = self._sends.get(rid)
            if send is not None:
                send.finished = True
                if not send.ended:
                    for piece in send.pieces:
                        piece.channel.cancel(piece.state.transfer_id)
                    send.ended = True
        done: set[str] = set()
        for rid, send in list(self._sends.items()):
            if send.finished and all(
                    (state := piece.channel.poll(piece.state.transfer_id)) is None
                    or state.settled for piece in send.pieces):
                done.add(rid)
                for piece in send.pieces:
                    piece.channel.forget(piece.state.transfer_id)
                del self._sends[rid]
        if done:
            self._drop_lost_channels()
        return done

    def _drop_lost_channels(self) -> None:
        in_use = {id(piece.channel) for send in self._sends.values() for piece in send.pieces}
        for key, ch in list(self._channels.items()):
            if id(ch) not in in_use and not ch.connected:
                ch.close()
                del self._channels[key]

    @property
    def channels(self) -> int:
        """Channels open to Ds."""
        return len(self._channels)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
