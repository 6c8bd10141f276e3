"""shm transport (same host): P copies the layer's bytes straight into D's staging segment,
which it maps after the handshake (the segment is owner-only, 0600), then sends the LAYER frame
with no inline payload. One memcpy from P's blocks into D's staging."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from splitserve.connector.layout import KVShape
from splitserve.connector.protocol import Op, ProtocolError, send_frame
from splitserve.connector.staging import SharedSegment
from splitserve.connector.transport.base import LayerItem, PushChannel, SendState


class ShmPushChannel(PushChannel):
    shape: KVShape  # set by the worker before first use
    _segment: SharedSegment | None = None

    def on_connected(self, staging_info: dict[str, Any]) -> None:
        path = staging_info.get("shm_path")
        if not path:
            raise ProtocolError("peer offers no shared-memory staging (not on this host?)")
        if self._segment is None or self._segment.path != path:
            self._segment = SharedSegment(0, path=str(path))

    def write_payload(self, sock: socket.socket, st: SendState, item: LayerItem) -> int:
        assert self._segment is not None
        seg = self._segment.tensor.numpy()
        row_bytes = self.shape.head_dim * self.shape.elem_bytes
        heads = self.shape.num_kv_heads
        for g, pieces in enumerate(item.groups):
            kv, h = divmod(g, heads)
            pos = st.offset + self.shape.row_offset(st.num_tokens, item.layer, kv, h, item.start)
            for p in pieces:
                n = len(p)
                np.copyto(seg[pos:pos + n], np.frombuffer(p, dtype=np.uint8))
                pos += n
        nbytes = (item.end - item.start) * row_bytes * 2 * heads
        send_frame(sock, Op.LAYER, self.layer_header(item, nbytes) | {"inline": False})
        return 0
