"""The worker's KV event relay (`worker.kvrelay`) against an in-process stand-in for vLLM's ZMQ
publisher (same wire: PUB `[topic, seq, msgpack batch]`, a ROUTER that replays its last batches
from a seq and ends with seq -1): startup, gaps, a lost last batch, a gap it cannot fill, the
long poll. No vLLM process: `tests/worker/test_kv_events.py` runs a real engine."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from splitserve.common.privatedir import (
    DIR_PREFIX,
    RUNTIME_DIR_ENV,
    private_dir,
    remove_private_dir,
)
from splitserve.kvindex.blockset import BlockSet, Cleared, Gone, Removed, Stored
from splitserve.kvindex.keys import prefix_keys
from splitserve.worker.kvrelay import (
    Relay,
    decode_batch,
    endpoints,
    events_config,
)

BS = 4
END = (-1).to_bytes(8, "big", signed=True)


def stored(tokens: list[int], **kw: Any) -> dict[str, Any]:
    """vLLM's BlockStored as msgspec encodes it (a map tagged by `type`), blocks from 0."""
    n = len(tokens) // BS
    return {"type": "BlockStored", "block_hashes": [hash_of(tokens[:(i + 1) * BS])
                                                    for i in range(n)],
            "parent_block_hash": None, "token_ids": tokens[:n * BS], "block_size": BS,
            "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0, **kw}


def removed(tokens: list[int], block: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [hash_of(tokens[:(block + 1) * BS])],
            "medium": "GPU", "group_idx": 0}


def hash_of(prefix: list[int]) -> bytes:
    return hashlib.sha256(repr(prefix).encode()).digest()


class FakeEngine:
    """vLLM's `ZmqEventPublisher` on the wire, in this process."""

    def __init__(self, directory: str, buffer: int = 1000) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        pub, replay = endpoints(directory)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(pub)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, *events: dict[str, Any], drop: bool = False) -> int:
        """One batch; `drop`: kept for replay but never reaches subscribers (ZMQ's HWM)."""
        payload = msgspec.msgpack.encode([time.time(), list(events), None])
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        while not self.stopped.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            with self.lock:
                items = [(s, b) for s, b in self.buffer if s >= int.from_bytes(start, "big")]
            for s, b in items:
                self.router.send_multipart([client, b"", b"", s.to_bytes(8, "big"), b])
            self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


@pytest.fixture
def sockets_dir() -> Iterator[str]:
    d = private_dir()
    yield d
    remove_private_dir(d)


@pytest.fixture
def engine(sockets_dir: str) -> Iterator[FakeEngine]:
    e = FakeEngine(sockets_dir)
    yield e
    e.close()


@pytest.fixture
async def start_relay(sockets_dir: str) -> AsyncIterator[Callable[..., Relay]]:
    started: list[Relay] = []

    def start(**kw: Any) -> Relay:
        pub, replay = endpoints(sockets_dir)
        relay = Relay(BlockSet(BS), pub, replay, **kw)
        relay.start(asyncio.get_running_loop())
        started.append(relay)
        return relay

    yield start
    for r in started:
        r.stop()


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def subscribed(engine: FakeEngine, relay: Relay) -> None:
    """Publish empty batches until one reaches the relay over PUB (its subscription is live)."""
    deadline = time.monotonic() + 5
    while True:
        seq = engine.publish()
        await asyncio.sleep(0.05)
        if relay.expected > seq and relay.batches > relay.replayed:
            return
        assert time.monotonic() < deadline


A = list(range(100, 112))
B = list(range(200, 208))


def test_decode_batch_reads_vllms_wire() -> None:
    payload = msgspec.msgpack.encode([1.5, [stored(A), removed(A, 2), {"type": "AllBlocksCleared"},
                                           {"type": "SomethingNewer", "x": 1}], 0])
    events = decode_batch(payload)
    assert [type(e) for e in events] == [Stored, Removed, Cleared]
    s = events[0]
    assert isinstance(s, Stored)
    assert (s.block_size, s.group, s.medium, s.lora, len(s.hashes)) == (BS, 0, "GPU", False, 3)
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
                msgspec.msgpack.encode([1.0, [stored(A, extra_keys=[None])]])):
        with pytest.raises(ValueError):
            decode_batch(bad)


def test_the_engines_sockets_are_ipc_in_a_private_directory(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path_factory.mktemp("rt")
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(parent))
    d = private_dir()
    assert Path(d).parent == parent and Path(d).name.startswith(DIR_PREFIX)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    cfg = events_config(d)
    assert cfg["endpoint"] == f"ipc://{d}/pub" and cfg["replay_endpoint"] == f"ipc://{d}/replay"
    assert cfg["enable_kv_cache_events"] and cfg["publisher"] == "zmq"
    other = parent / "not-ours"
    other.mkdir()
    remove_private_dir(str(other))
    remove_private_dir(d)
    assert other.exists() and not Path(d).exists()


async def test_the_relay_catches_up_at_start_and_long_polls(
        engine: FakeEngine, start_relay: Callable[..., Relay]) -> None:
    engine.publish(stored(A))  # before the relay subscribed: only the replay buffer has it
    relay = start_relay(probe_s=60)
    await until(lambda: len(relay.snapshot().keys) == 3)
    snap = relay.snapshot()
    assert snap.exact and set(snap.keys) == set(prefix_keys(A, BS)) and snap.seq == 1
    await subscribed(engine, relay)
    poll = asyncio.create_task(relay.events(snap.seq, wait_s=10, epoch=snap.epoch))
    await asyncio.sleep(0.1)
    assert not poll.done()
    t0 = time.monotonic()
    engine.publish(removed(A, 2), stored(B))
    ev = await poll
    assert time.monotonic() - t0 < 2
    assert [c.seq for c in ev.changes] == [2] and ev.seq == 2
    assert ev.changes[0].removed == (prefix_keys(A, BS)[2],)
    assert set(ev.changes[0].stored) == set(prefix_keys(B, BS))
    empty = await relay.events(2, wait_s=0.2)
    assert empty.changes == () and empty.seq == 2 and empty.epoch == snap.epoch


async def test_a_gap_is_filled_from_the_replay_buffer(
        engine: FakeEngine, start_relay: Callable[..., Relay]) -> None:
    relay = start_relay(probe_s=60)
    await subscribed(engine, relay)
    engine.publish(stored(A), drop=True)
    engine.publish(stored(B))
    await until(lambda: len(relay.snapshot().keys) == 5)
    assert relay.snapshot().exact and relay.gaps == 1 and relay.replayed >= 1


async def test_a_lost_last_batch_is_found_while_the_stream_is_quiet(
        engine: FakeEngine, start_relay: Callable[..., Relay]) -> None:
    relay = start_relay(probe_s=0.3)
    await subscribed(engine, relay)
    engine.publish(stored(A), drop=True)
    await until(lambda: len(relay.snapshot().keys) == 3)
    assert relay.snapshot().exact


async def test_a_gap_the_buffer_cannot_fill_gives_the_view_up_until_a_clear(
        sockets_dir: str, start_relay: Callable[..., Relay]) -> None:
    engine = FakeEngine(sockets_dir, buffer=2)
    try:
        relay = start_relay(probe_s=60)
        await subscribed(engine, relay)
        engine.publish(stored(A))
        await until(lambda: len(relay.snapshot().keys) == 3)
        epoch = relay.snapshot().epoch
        for _ in range(3):
            engine.publish(removed(A, 2), drop=True)  # the first falls out of the buffer
        engine.publish(stored(B))
        await until(lambda: not relay.snapshot().exact)
        snap = relay.snapshot()
        assert snap.keys == () and snap.epoch != epoch and "lost engine batches" in str(
            snap.reason)
        with pytest.raises(Gone):
            await relay.events(0)
        engine.publish({"type": "AllBlocksCleared"}, stored(B))
        await until(lambda: relay.snapshot().exact)
        snap = relay.snapshot()
        assert set(snap.keys) == set(prefix_keys(B, BS)) and snap.epoch != epoch
        assert relay.blocks.epochs_lost == 1
    finally:
        engine.close()


async def test_a_relay_that_does_not_report_says_why() -> None:
    relay = Relay.not_reporting(128, "the engine's prefix caching is off")
    relay.start(asyncio.get_running_loop())
    snap = relay.snapshot()
    assert (snap.exact, snap.keys, snap.reason, snap.block_size) == (
        False, (), "the engine's prefix caching is off", 128)
    assert not relay.reporting and relay.blocks.epochs_lost == 0
    with pytest.raises(Gone):
        await relay.events(0, wait_s=1)
    relay.stop()


async def test_a_batch_the_view_cannot_apply_gives_it_up_and_the_relay_follows_on(
        engine: FakeEngine, start_relay: Callable[..., Relay]) -> None:
    relay = start_relay(probe_s=60)
    await subscribed(engine, relay)
    engine.publish(stored(A, token_ids=["x"] * len(A)))  # decodes, but keys no block
    await until(lambda: not relay.snapshot().exact)
    assert "not applied" in str(relay.snapshot().reason)
    engine.publish({"type": "AllBlocksCleared"}, stored(B))
    await until(lambda: relay.snapshot().exact)
    assert set(relay.snapshot().keys) == set(prefix_keys(B, BS))
