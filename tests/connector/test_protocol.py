"""Framing on the KV channel: a frame and its payload sent as parts arrive byte-exact and in
order, however the kernel splits the gathering send; typed message bodies round-trip, and a
malformed body is a protocol error, not a default."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from splitserve.connector.framing import (
    IOV_MAX,
    Op,
    ProtocolError,
    encode_frame,
    recv_exact_into,
    recv_frame,
    send_parts,
)
from splitserve.connector.messages import Abort, Ack, Begin, Layer, Query, decode, recv, send


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


def test_more_parts_than_one_sendmsg_takes_all_arrive() -> None:
    """An END after thousands of payload-less LAYER frames (shm: layers x chunks) is more
    buffers than one `sendmsg` takes (IOV_MAX); they leave in several calls, in order."""
    a, b = socket.socketpair()
    parts = [encode_frame(Op.LAYER, {"transfer_id": "t", "layer": i, "nbytes": 0})
             for i in range(3 * IOV_MAX + 5)]
    frames: list[tuple[Op, dict[str, object]]] = []
    reader = threading.Thread(target=lambda: frames.extend(recv_frame(b) for _ in parts))
    reader.start()
    with a, b:
        send_parts(a, parts)
        reader.join(10)
    assert not reader.is_alive()
    assert [body["layer"] for _, body in frames] == list(range(len(parts)))


def test_messages_round_trip_and_leave_out_unset_fields() -> None:
    layer = Layer("t", 3, 0, 128, 4096, "00ff", inline=False, written_s=12.5)
    assert decode(Op.LAYER, json.loads(json.dumps(layer.to_wire()))) == layer
    assert Layer("t", 0, 0, 1, 8, "ab").to_wire() == {
        "transfer_id": "t", "layer": 0, "start": 0, "end": 1, "nbytes": 8, "checksum": "ab",
        "inline": True}
    assert Ack("t", True).to_wire() == {"transfer_id": "t", "ok": True}
    assert decode(Op.ACK, {"transfer_id": "t", "ok": False, "cause": "x"}) == Ack("t", False, "x")
    assert decode(Op.QUERY, {"what": "state"}) == Query("state")


@pytest.mark.parametrize(("op", "body", "problem"), [
    (Op.BEGIN, {"transfer_id": "t"}, "lacks 'tokens'"),
    (Op.BEGIN, {"transfer_id": "t", "tokens": "10"}, "'tokens' is not"),
    (Op.BEGIN_OK, {"transfer_id": "t", "offset": True}, "'offset' is not"),
    (Op.LAYER, {"transfer_id": "t", "layer": 0, "start": 0, "end": 1, "nbytes": 8,
                "checksum": "ab", "written_s": "now"}, "'written_s' is not"),
    (Op.ACK, [], "not an object"),
])
def test_malformed_bodies_are_protocol_errors(op: Op, body: object, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        decode(op, body)


def test_typed_messages_cross_a_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        send(a, Begin("t", 300))
        send(a, Abort("t"))
        assert recv(b) == Begin("t", 300)
        assert recv(b) == Abort("t")
