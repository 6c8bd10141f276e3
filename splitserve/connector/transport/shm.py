"""shm transport (same host): P gathers the chunk's rows from its blocks straight into D's
staging segment (one copy), which it maps after the handshake (the segment is owner-only, 0600),
then sends the LAYER frame (no inline payload). Only a transfer's first frame goes at once (D
stamps the transfer's first byte by it); the rest go out with END in one send, so D wakes twice
per transfer rather than once per layer, and P's core is spared a send per layer during the
forward pass."""

from __future__ import annotations

from typing import Any

from splitserve.connector.layout import region_offset
from splitserve.connector.protocol import Op, ProtocolError, encode_frame
from splitserve.connector.segment import SharedSegment
from splitserve.connector.tls import Conn
from splitserve.connector.transport.base import LayerItem, PushChannel, SendState


class ShmPushChannel(PushChannel):
    _segment: SharedSegment | None = None

    def on_connected(self, staging_info: dict[str, Any]) -> None:
        path = staging_info.get("shm_path")
        if not path:
            raise ProtocolError("peer offers no shared-memory staging (not on this host?)")
        if self._segment is None or self._segment.path != path:
            self._segment = SharedSegment(0, path=str(path))

    def write_payload(self, sock: Conn, st: SendState, item: LayerItem) -> None:
        assert self._segment is not None
        nbytes = (item.end - item.start) * self.shape.bytes_per_token_layer
        base = st.offset + region_offset(self.shape, item.start, item.end, item.layer)
        region = self._segment.tensor[base:base + nbytes]
        item.gather_into(self.shape, region)
        header = self.layer_header(item, memoryview(region.numpy()))
        frame = encode_frame(Op.LAYER, header | {"inline": False})
        if st.first_layer_sent:
            st.unsent.append(frame)
        else:
            sock.sendall(frame)
            st.first_layer_sent = True
