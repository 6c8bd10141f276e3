"""The KV channel of a real decode worker refuses anyone without the deployment token, and a
pusher whose model differs, before any KV moves."""

from __future__ import annotations

import os
import socket
import time

import pytest

from splitserve.connector.framing import Op, ProtocolError, recv_frame, send_frame
from splitserve.connector.protocol import Fingerprint, connect
from tests.support.workers import TOKEN, Worker


def d_fingerprint(d: Worker) -> Fingerprint:
    return Fingerprint(**d.state()["model_fingerprint"])


def test_wrong_token_is_refused(llama_pair: tuple[Worker, Worker]) -> None:
    _, d = llama_pair
    with pytest.raises(ProtocolError, match="refused by peer: authentication failed"):
        connect("127.0.0.1", d.kv_port, "wrong-token", "push", d_fingerprint(d), 5.0)


def test_begin_without_handshake_is_dropped(llama_pair: tuple[Worker, Worker]) -> None:
    _, d = llama_pair
    before = d.state()["transfers"]["counts"]
    with socket.create_connection(("127.0.0.1", d.kv_port), timeout=5) as s:
        op, _ = recv_frame(s)  # HELLO
        assert op == Op.HELLO
        send_frame(s, Op.BEGIN, {"transfer_id": "intruder", "tokens": 10})
        op, body = recv_frame(s)
        assert op == Op.REFUSE
        with pytest.raises((ProtocolError, OSError)):
            recv_frame(s)  # the listener hung up
    assert d.state()["transfers"]["counts"] == before
    assert d.state()["staged_bytes"] == 0


def test_model_mismatch_is_refused(llama_pair: tuple[Worker, Worker]) -> None:
    _, d = llama_pair
    fp = d_fingerprint(d)
    other = Fingerprint(**{**fp.__dict__, "num_kv_heads": fp.num_kv_heads * 2})
    with pytest.raises(ProtocolError, match="model mismatch: num_kv_heads"):
        connect("127.0.0.1", d.kv_port, TOKEN, "push", other, 5.0)


def test_right_token_and_model_may_stage(llama_pair: tuple[Worker, Worker]) -> None:
    _, d = llama_pair
    sock, info = connect("127.0.0.1", d.kv_port, TOKEN, "push", d_fingerprint(d), 5.0)
    with sock:
        assert info.shm_path is not None and info.shm_path.startswith("/dev/shm/splitserve-")
        assert os.stat(info.shm_path).st_mode & 0o777 == 0o600  # owner-only segment
        send_frame(sock, Op.BEGIN, {"transfer_id": "probe-too-big", "tokens": 10**9})
        op, body = recv_frame(sock)
        assert op == Op.BEGIN_REFUSED and body["cause"] == "staging_full"
        send_frame(sock, Op.BEGIN, {"transfer_id": "probe-ok", "tokens": 16})
        op, body = recv_frame(sock)
        assert op == Op.BEGIN_OK
        assert d.state()["staged_bytes"] > 0
    # the connection dropped before END: the transfer failed and its region is free again
    deadline = time.monotonic() + 5
    while d.state()["staged_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.state()["staged_bytes"] == 0
