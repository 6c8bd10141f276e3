"""The worker's relay of its engine's KV cache events: vLLM's ZMQ publisher in, an exact key set
(`kvindex.blockset.BlockSet`) and its changes out, served by the endpoint plugin
(`worker.plugin`) on `kvindex.messages`' two routes behind the deployment token.

The engine publishes privately. `worker.launch.worker_command` starts every worker (P, D,
colocated; either connector) with `--kv-events-config` naming two `ipc://` sockets in a
directory of its own (`common.privatedir`: mode 0700), so only this user's
processes can connect: no TCP port, on any interface. The engine core binds both: a PUB socket
(each batch as `[topic, seq (8 bytes, big-endian), msgpack KVEventBatch]`) and a ROUTER that
replays the last `BUFFER_STEPS` batches from a given seq. The plugin removes the directory when
the API server exits; the worker's guard and its launcher remove it however it ends.

Exactness (the `BlockSet` is exact while every engine batch is applied, in order):
- The engine numbers its batches 0, 1, 2, ... for its whole life, which is the API server's: the
  relay starts in the API server after the engine core is up, but before the HTTP server takes
  any request, so the engine has published nothing yet or very little.
- ZMQ's PUB drops whatever is published before a subscription reaches it (slow joiner) or
  beyond its high-water mark. So the relay asks the replay socket for every batch from the next
  one it expects (`expected`): once right after it subscribes, whenever a batch arrives with a
  seq beyond `expected` (a gap), and every `probe_s` seconds while the stream is quiet (a lost
  last batch shows no gap until the next one). Duplicates (a batch seen by both paths) are
  skipped by seq.
- When the replay buffer no longer holds the batch expected (or does not answer a gap), the
  relay cannot know the set: `BlockSet.lose` starts a new epoch that is not exact (empty, routes
  answer `exact: false` and 410) until the engine clears its prefix cache. Never a wrong set.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from splitserve.kvindex.blockset import (
    BlockHash,
    BlockSet,
    Cleared,
    EngineEvent,
    Gone,
    Removed,
    Stored,
)
from splitserve.kvindex.messages import MAX_WAIT_S, KvEvents, KvSnapshot

log = logging.getLogger("splitserve.kvrelay")

KV_EVENTS_DIR_ENV = "SPLITSERVE_KV_EVENTS_DIR"  # set by worker_command: the worker's socket dir
PUB_NAME, REPLAY_NAME = "pub", "replay"
BUFFER_STEPS = 1000  # engine batches the replay socket keeps (the engine's memory, not ours)
END_SEQ = -1  # the replay socket's end-of-answer marker


def endpoints(directory: str) -> tuple[str, str]:
    """The engine's PUB and replay endpoints in a worker's private directory."""
    return f"ipc://{directory}/{PUB_NAME}", f"ipc://{directory}/{REPLAY_NAME}"


def events_config(directory: str) -> dict[str, Any]:
    """vLLM's `--kv-events-config` for a worker whose sockets live in `directory`."""
    pub, replay = endpoints(directory)
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
            "replay_endpoint": replay, "buffer_steps": BUFFER_STEPS, "topic": ""}


# -- vLLM's wire -------------------------------------------------------------------------------

def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list) or not all(isinstance(h, bytes | int) for h in raw):
        raise ValueError("block_hashes must be a list of bytes or ints")
    return tuple(raw)


def _opt_int(ev: dict[str, Any], key: str) -> int | None:
    value = ev.get(key)
    if value is not None and not isinstance(value, int):
        raise ValueError(f"{key} must be an int")
    return value


def _event(ev: Any) -> EngineEvent | None:
    if not isinstance(ev, dict):
        raise ValueError("an event must be a map")
    kind = ev.get("type")
    if kind == "AllBlocksCleared":
        return Cleared()
    medium = ev.get("medium")
    if kind == "BlockRemoved":
        return Removed(_hashes(ev.get("block_hashes")), _opt_int(ev, "group_idx"), medium)
    if kind == "BlockStored":
        tokens, extra = ev.get("token_ids"), ev.get("extra_keys")
        parent, size = ev.get("parent_block_hash"), ev.get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int):
            raise ValueError("BlockStored needs token_ids and block_size")
        if parent is not None and not isinstance(parent, bytes | int):
            raise ValueError("parent_block_hash must be bytes or an int")
        if extra is not None and not isinstance(extra, list):
            raise ValueError("extra_keys must be a list")
        hashes = _hashes(ev.get("block_hashes"))
        if extra is not None and len(extra) != len(hashes):
            raise ValueError("extra_keys must have one entry per block")
        return Stored(hashes=hashes, parent=parent, token_ids=tuple(tokens), block_size=size,
                      group=_opt_int(ev, "group_idx"), medium=medium,
                      lora=ev.get("lora_name") is not None or ev.get("lora_id") is not None,
                      extra_keys=None if extra is None else tuple(extra))
    return None  # a kind this relay does not know (a newer vLLM): it changes nothing we key


def decode_batch(payload: bytes) -> list[EngineEvent]:
    """The events of one `KVEventBatch` (msgspec msgpack, array-like: `[ts, events, dp_rank]`;
    each event a map tagged by `type`). ValueError on anything else."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("a batch is [ts, events, ...]")
    return [e for e in map(_event, raw[1]) if e is not None]


# -- the relay ---------------------------------------------------------------------------------

class Relay:
    """Subscribes to the engine's events on a thread of its own; the API server's event loop
    reads `snapshot()` and awaits `events()`. `BlockSet` is guarded by `lock`."""

    def __init__(self, blocks: BlockSet, pub: str | None, replay: str | None, *,
                 probe_s: float = 2.0, replay_timeout_s: float = 2.0) -> None:
        self.blocks = blocks
        self.pub, self.replay = pub, replay
        self.probe_s, self.replay_timeout_s = probe_s, replay_timeout_s
        self.lock = threading.Lock()
        self.expected = 0  # the engine's next batch
        self.batches = 0  # engine batches applied
        self.replayed = 0  # of which read from the replay socket
        self.gaps = 0  # times a batch arrived beyond the one expected
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Future[None]] = set()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None

    @classmethod
    def not_reporting(cls, block_size: int, reason: str) -> Relay:
        """A relay that never subscribes: its snapshot says why (`exact: false`)."""
        blocks = BlockSet(block_size)
        blocks.lose(reason)
        blocks.epochs_lost = 0
        return cls(blocks, None, None)

    @property
    def reporting(self) -> bool:
        return self.pub is not None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if self.pub is None:
            return
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="splitserve-kv-relay",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    # -- read by the API server ------------------------------------------------------------

    def snapshot(self) -> KvSnapshot:
        with self.lock:
            return self.blocks.snapshot()

    async def events(self, after: int, wait_s: float = 0.0, epoch: str | None = None
                     ) -> KvEvents:
        """The changes after `after`, waiting up to `wait_s` (at most `MAX_WAIT_S`) for one;
        `Gone` when they cannot be had. Never blocks the event loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(wait_s, MAX_WAIT_S))
        while True:
            with self.lock:
                self.blocks.check_after(after, epoch)
                if after < self.blocks.seq:
                    return self.blocks.events_after(after, epoch)
                now_epoch = self.blocks.epoch
            remaining = deadline - loop.time()
            if remaining <= 0:
                return KvEvents(epoch=now_epoch, seq=after, block_size=self.blocks.block_size)
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(fut)

    def _wake(self) -> None:
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(None)

    def _notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed meanwhile
                pass

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        """Follow the engine until stopped. A failure gives the view up (it stays given up
        until the engine clears its cache) and the relay follows again on fresh sockets, after
        1 s and then up to 30 s between tries while they keep failing, so that a later clear is
        seen. The first failure is logged with its traceback, later ones in a line."""
        wait_s = 1.0
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception as exc:  # the view cannot follow the engine on these sockets
                if self._stop.is_set():
                    return
                if wait_s == 1.0:
                    log.exception("KV event relay failed; following again in 1 s")
                else:
                    log.warning("KV event relay failed again (%r); next try in %.0f s", exc,
                                wait_s)
                self._lose(self.expected, f"the relay failed: {exc}")
                self._stop.wait(wait_s)
                wait_s = min(30.0, wait_s * 2)

    def _follow(self) -> None:
        assert self._ctx is not None and self.pub is not None
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.pub)
            self._catch_up()
            quiet_since = time.monotonic()
            while not self._stop.is_set():
                if sub.poll(200):
                    frames = sub.recv_multipart()
                    quiet_since = time.monotonic()
                    if len(frames) == 3:
                        self._on_published(int.from_bytes(frames[1], "big"), frames[2])
                elif time.monotonic() - quiet_since >= self.probe_s:
                    self._catch_up()
                    quiet_since = time.monotonic()
        finally:
            sub.close(linger=0)

    def _on_published(self, seq: int, payload: bytes) -> None:
        if seq > self.expected:
            self.gaps += 1
            self._catch_up()
        if seq < self.expected:
            return  # seen already (replayed)
        if seq > self.expected:
            self._lose(seq, f"lost engine batches {self.expected}..{seq - 1} (not replayable)")
        self._apply(seq, payload)

    def _catch_up(self) -> None:
        """Apply every batch from `expected` on that the engine's replay socket still holds."""
        if self.replay is None or self._ctx is None:
            return
        sock = self._ctx.socket(zmq.DEALER)  # a fresh one: no late answer to an earlier ask
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.replay)
            sock.send_multipart([b"", self.expected.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    log.warning("the engine's replay socket did not answer in %.1f s",
                                self.replay_timeout_s)
                    return
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq < self.expected:
                    continue
                if seq > self.expected:
                    self._lose(seq, f"lost engine batches {self.expected}..{seq - 1} "
                                    f"(the replay buffer no longer holds them)")
                self._apply(seq, frames[3])
                self.replayed += 1
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except ValueError as exc:
            self._lose(seq + 1, f"engine batch {seq} undecodable: {exc}")
            return
        with self.lock:
            before = (self.blocks.epoch, self.blocks.seq)
            try:
                self.blocks.apply(events)
            except Exception as exc:  # a batch out of shape: the view can no longer vouch
                log.warning("engine batch %d not applied: %r", seq, exc)
                self.blocks.lose(f"engine batch {seq} not applied: {exc!r}")
            changed = (self.blocks.epoch, self.blocks.seq) != before
            self.expected = seq + 1
            self.batches += 1
        if changed:
            self._notify()

    def _lose(self, next_seq: int, reason: str) -> None:
        log.warning("KV cache view given up: %s", reason)
        with self.lock:
            self.blocks.lose(reason)
            self.expected = next_seq
        self._notify()


class RelayCollector:
    """Prometheus families of the relay (`splitserve_kv_events_*`)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        r = self.relay
        with r.lock:
            b = r.blocks
            values = (len(b), b.entries, int(b.exact), b.changes_total, b.epochs_lost)
        held, entries, exact, changes, lost = values
        for name, doc, value in (
                ("blocks", "block keys the engine holds, as the relay reports them", held),
                ("entries", "prefix-cache entries the relay counts (keyed or not)", entries),
                ("exact", "1 while the relay's view of the engine's cache is exact", exact)):
            g = GaugeMetricFamily(f"splitserve_kv_events_{name}", doc)
            g.add_metric([], float(value))
            yield g
        for name, doc, value in (
                ("changes", "changes of the key set relayed", changes),
                ("epoch_restarts", "times the relay gave its view up (lost engine events)", lost),
                ("batches", "engine event batches applied", r.batches),
                ("replayed", "engine event batches read from the engine's replay socket",
                 r.replayed),
                ("gaps", "times an engine batch arrived beyond the one expected", r.gaps)):
            c = CounterMetricFamily(f"splitserve_kv_events_{name}", doc)
            c.add_metric([], float(value))
            yield c


__all__ = ["Gone", "Relay", "RelayCollector", "decode_batch", "endpoints", "events_config"]
