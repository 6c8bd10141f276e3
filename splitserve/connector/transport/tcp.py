"""tcp transport: P gathers the chunk's rows from its blocks into a reusable send buffer (one
copy) and sends them right after the LAYER frame; D `recv_into`s its staging region."""

from __future__ import annotations

import json
from typing import Any

import torch

from splitserve.connector.protocol import HEADER, MAGIC, Op
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
        body = json.dumps(self.layer_header(item, payload), separators=(",", ":")).encode()
        sock.sendall(HEADER.pack(MAGIC, int(Op.LAYER), len(body)) + body)
        sock.sendall(payload)
