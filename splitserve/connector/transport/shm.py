"""shm transport (same host): P gathers the chunk's rows from its blocks straight into D's
staging segment (one copy), which it maps after the handshake (the segment is owner-only, 0600).
The copy runs on the forward thread once BEGIN_OK named the transfer's offset (the sender thread
does it before then). LAYER frames carry no payload and are all held until END, so D wakes once
per transfer and P's core pays no send per layer during the forward pass; each frame carries
the wall time its payload was written (same host, same clock), which D records as the
transfer's first byte."""

from __future__ import annotations

import time

from splitserve.connector.framing import ProtocolError
from splitserve.connector.layout.staging_format import region_offset
from splitserve.connector.messages import StagingInfo, encode
from splitserve.connector.segment import SharedSegment
from splitserve.connector.tls import Conn
from splitserve.connector.transport.base import LayerItem, PushChannel, SendState


class ShmPushChannel(PushChannel):
    _segment: SharedSegment | None = None

    def on_connected(self, staging_info: StagingInfo) -> None:
        path = staging_info.shm_path
        if not path:
            raise ProtocolError("peer offers no shared-memory staging (not on this host?)")
        if self._segment is None or self._segment.path != path:
            self._segment = SharedSegment(0, path=path)

    def stage_now(self, st: SendState, item: LayerItem) -> bool:
        if st.offset < 0:
            return False  # D has not answered BEGIN yet
        self._stage(st, item)
        return True

    def write_payload(self, sock: Conn, st: SendState, item: LayerItem) -> None:
        self._stage(st, item)

    def _stage(self, st: SendState, item: LayerItem) -> None:
        segment = self._segment  # a reconnect may map a new one; this copy keeps its own
        assert segment is not None
        nbytes = (item.end - item.start) * self.shape.bytes_per_token_layer
        base = st.offset + region_offset(self.shape, item.start, item.end, item.layer)
        region = segment.tensor[base:base + nbytes]
        item.gather_into(region)
        frame = self.layer_frame(item, memoryview(region.numpy()), inline=False,
                                 written_s=time.time())
        st.unsent.append(encode(frame))
