"""tcp transport: P gathers the chunk's rows from its blocks into a send buffer (one copy) and
the sender thread sends them with the LAYER frame in one gathering send; D `recv_into`s its
staging region. On the forward thread the gather goes into a buffer from a bounded pool, which
the sender returns once the bytes are on the socket; with the pool exhausted (a slow peer) the
layer waits for the sender thread, which gathers into its own reusable buffer."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from splitserve.connector.framing import send_parts
from splitserve.connector.messages import StagingInfo, encode
from splitserve.connector.tls import Conn
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.items import CopiedLayer, LayerItem, ReadyLayer, SendState

POOL_BYTES = 64 * 1024**2  # payload buffers held for the sender, per channel


class BufferPool:
    """Reusable uint8 buffers, at most `limit` bytes of them allocated at once (thread-safe).
    New buffers come from `alloc` (the layout's `host_buffer`, plain memory by default)."""

    def __init__(self, limit: int, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.limit = limit
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            while self._free and self._allocated + nbytes > self.limit:
                self._allocated -= self._free.pop().numel()  # too small: make room
            if self._allocated + nbytes > self.limit:
                return None
            self._allocated += nbytes
        return self._alloc(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    @property
    def allocated(self) -> int:
        return self._allocated


class TcpPushChannel(PushChannel):
    _buffer: torch.Tensor | None = None  # the sender thread's own
    _pool: BufferPool | None = None

    def on_connected(self, staging_info: StagingInfo) -> None:
        return None

    def stage_now(self, st: SendState, item: LayerItem) -> bool:
        if self._pool is None:
            self._pool = BufferPool(POOL_BYTES, item.layout.host_buffer)
        pool = self._pool
        nbytes = (item.end - item.start) * self.shape.bytes_per_token_layer
        buf = pool.take(nbytes)
        if buf is None:
            return False
        region = buf[:nbytes]
        try:
            done = self.copier.save(item.layout, item.block_ids, item.start, item.end, region)
        except BaseException:
            pool.give(buf)
            raise
        if done is None:
            pool.give(buf)
            return False  # the copier's buffers are all in flight: the sender copies it
        if done.done():
            self.queue_ready(ReadyLayer(item.transfer_id, self._parts(item, region),
                                        lambda: pool.give(buf)))
        else:
            self.queue_copied(CopiedLayer(item, region, done, lambda: pool.give(buf)))
        return True

    def write_payload(self, sock: Conn, st: SendState, item: LayerItem) -> None:
        nbytes = (item.end - item.start) * self.shape.bytes_per_token_layer
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = item.layout.host_buffer(max(nbytes, 1 << 20))
        region = self._buffer[:nbytes]
        item.gather_into(region)
        send_parts(sock, self._parts(item, region))

    def send_copied(self, st: SendState, copied: CopiedLayer) -> None:
        send_parts(self._ensure_connected(), self._parts(copied.item, copied.region))

    def _parts(self, item: LayerItem, region: torch.Tensor) -> list[bytes | memoryview]:
        payload = memoryview(region.numpy())
        return [encode(self.layer_frame(item, payload)), payload]
