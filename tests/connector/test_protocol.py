"""Framing on the KV channel: a frame and its payload sent as parts arrive byte-exact and in
order, however the kernel splits the gathering send."""

from __future__ import annotations

import socket
import threading

from splitserve.connector.protocol import (
    Op,
    encode_frame,
    recv_exact_into,
    recv_frame,
    send_parts,
)


def test_parts_arrive_in_order_across_partial_sends() -> None:
    a, b = socket.socketpair()
    # a small send buffer forces sendmsg to return partial counts mid-part
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = bytes(range(256)) * 4096  # 1 MiB, far larger than the buffer
    frame = encode_frame(Op.LAYER, {"transfer_id": "t", "nbytes": len(payload)})
    tail = encode_frame(Op.END, {"transfer_id": "t"})
    got = bytearray(len(payload))
    frames: list[tuple[Op, dict[str, object]]] = []

    def read() -> None:
        frames.append(recv_frame(b))
        recv_exact_into(b, memoryview(got))
        frames.append(recv_frame(b))

    reader = threading.Thread(target=read)
    reader.start()
    with a, b:
        send_parts(a, [frame, memoryview(payload), b"", tail])
        reader.join(10)
    assert not reader.is_alive()
    assert frames == [(Op.LAYER, {"transfer_id": "t", "nbytes": len(payload)}),
                      (Op.END, {"transfer_id": "t"})]
    assert bytes(got) == payload
