"""tcp transport: P gathers the chunk's rows from its blocks into a reusable send buffer (one
copy) and sends them with the LAYER frame in one gathering send; D `recv_into`s its staging
region."""

from __future__ import annotations

from typing import Any

import torch

from splitserve.connector.protocol import Op, encode_frame, send_parts
from splitserve.connector.tls import Conn
from splitserve.connector.transport.base import LayerItem, PushChannel, SendState


class TcpPushChannel(PushChannel):
    _buffer: torch.Tensor | None = None

    def on_connected(self, staging_info: dict[str, Any]) -> None:
        return None

    def write_payload(self, sock: Conn, st: SendState, item: LayerItem) -> None:
        nbytes = (item.end - item.start) * self.shape.bytes_per_token_layer
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        region = self._buffer[:nbytes]
        item.gather_into(self.shape, region)
        payload = memoryview(region.numpy())
        send_parts(sock, [encode_frame(Op.LAYER, self.layer_header(item, payload)), payload])
