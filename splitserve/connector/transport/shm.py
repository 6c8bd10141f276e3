"""shm transport (same host): P gathers the chunk's rows from its blocks straight into D's
staging segment (one copy), which it maps after the handshake (the segment is owner-only, 0600).
The copy runs on the forward thread once BEGIN_OK named the transfer's offset (the sender thread
does it before then). LAYER frames carry no payload and are all held until END, so D wakes once
per transfer and P's core pays no send per layer during the forward pass; each frame carries
the wall time its payload was written (same host, same clock), which D records as the
transfer's first byte."""

from __future__ import annotations

import time

import torch

from splitserve.connector.framing import ProtocolError
from splitserve.connector.layout.staging_format import region_offset
from splitserve.connector.messages import StagingInfo, encode
from splitserve.connector.segment import SharedSegment
from splitserve.connector.tls import Conn
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.items import CopiedLayer, LayerItem, SendState


class ShmPushChannel(PushChannel):
    _segment: SharedSegment | None = None

    def on_connected(self, staging_info: StagingInfo) -> None:
        path = staging_info.shm_path
        if not path:
            raise ProtocolError("peer offers no shared-memory staging (not on this host?)")
        if self._segment is None or self._segment.path != path:
            if self._segment is not None:
                self.copier.unregister_host(self._segment.tensor)
            self._segment = SharedSegment(0, path=path)
            self.copier.register_host(self._segment.tensor)  # device copies land in it directly

    def on_closed(self) -> None:
        # on the sender thread, after its queue (device copies into the segment) drained
        if self._segment is not None:
            self.copier.unregister_host(self._segment.tensor)

    def stage_now(self, st: SendState, item: LayerItem) -> bool:
        if st.offset < 0:
            return False  # D has not answered BEGIN yet
        region = self._region(st, item)
        done = self.copier.save(item.layout, item.block_ids, item.start, item.end, region)
        if done is None:
            return False  # the copier's buffers are all in flight: the sender copies it
        if done.done():
            self._hold_frame(st, item, region)
        else:
            self.queue_copied(CopiedLayer(item, region, done, _nothing))
        return True

    def write_payload(self, sock: Conn, st: SendState, item: LayerItem) -> None:
        region = self._region(st, item)
        item.gather_into(region)
        self._hold_frame(st, item, region)

    def send_copied(self, st: SendState, copied: CopiedLayer) -> None:
        self._hold_frame(st, copied.item, copied.region)

    def _region(self, st: SendState, item: LayerItem) -> torch.Tensor:
        segment = self._segment  # a reconnect may map a new one; this copy keeps its own
        assert segment is not None
        nbytes = (item.end - item.start) * self.shape.bytes_per_token_layer
        base = st.offset + region_offset(self.shape, item.start, item.end, item.layer, st.skip)
        return segment.tensor[base:base + nbytes]

    def _hold_frame(self, st: SendState, item: LayerItem, region: torch.Tensor) -> None:
        frame = self.layer_frame(item, memoryview(region.numpy()), inline=False,
                                 written_s=time.time())
        st.unsent.append(encode(frame))


def _nothing() -> None:
    return None
