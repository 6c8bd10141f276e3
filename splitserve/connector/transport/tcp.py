"""tcp transport: the layer's bytes follow its LAYER frame on the socket, straight from P's
paged KV memory (scatter-gather `sendmsg`, no gather copy); D `recv_into`s its staging region."""

from __future__ import annotations

import socket
from typing import Any

from splitserve.connector.protocol import HEADER, MAGIC, Op
from splitserve.connector.transport.base import LayerItem, PushChannel, SendState

IOV_MAX = 512


def sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send every buffer in order, handling partial sends."""
    i = 0
    while i < len(buffers):
        batch = buffers[i:i + IOV_MAX]
        sent = sock.sendmsg(batch)
        for buf in batch:
            if sent >= len(buf):
                sent -= len(buf)
                i += 1
            else:
                buffers[i] = buf[sent:]
                break


class TcpPushChannel(PushChannel):
    def on_connected(self, staging_info: dict[str, Any]) -> None:
        return None

    def write_payload(self, sock: socket.socket, st: SendState, item: LayerItem) -> int:
        import json

        nbytes = sum(len(p) for pieces in item.groups for p in pieces)
        body = json.dumps(self.layer_header(item, nbytes), separators=(",", ":")).encode()
        frame = memoryview(HEADER.pack(MAGIC, int(Op.LAYER), len(body)) + body)
        sendmsg_all(sock, [frame] + [p for pieces in item.groups for p in pieces])
        return nbytes
