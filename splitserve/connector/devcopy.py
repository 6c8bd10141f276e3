"""Where a layer's copies between the engine's KV cache and host staging run: the streams and
events of the connector's device path, behind one small interface.

Contract (the swap point between a CPU engine and a CUDA one):
- `save(layer, block_ids, start, end, region)` is called on P's forward thread right after the
  layer's KV was written. It returns a `Completion` once the copy of tokens [start, end) into
  the host `region` (the staging format) is queued, or None when its buffers are all in
  flight (the caller then copies later, on another thread, with `layer.gather`). It never
  waits for a device-to-host copy.
- `load(layer, block_ids, start, end, region, region_start)` is called on D's engine thread
  for a staged transfer whose host bytes were all checksummed; the copy into the blocks runs
  while the thread goes on. Same None rule.
- `mark()`, on the forward thread, returns what a copy made later on another thread waits for
  before it reads the layer (P's sender thread copies the layers the copier could not take).
- `Completion.wait()` blocks the calling thread (P's sender, never the forward thread) until
  the copy is complete: `region` holds the bytes (save) or the blocks do and `region` may be
  reused (load). `Completion.done()` asks without blocking. Until one of them has reported
  completion the caller keeps the blocks and the region alive, and the copier counts the
  copy's buffers against its bound.

`InlineCopies` (CPU engines) copies right there with the layout's own synchronous `gather` /
`scatter` and returns an already complete `Completion`: the CPU path is the synchronous copy
it always was. `CudaCopies` runs a layer's gather, its device-to-host copy (or the
host-to-device copy and scatter) on one side stream, ordered after the compute stream's work
by an event, into pinned memory where the region is pinned (or registered as pinned), else
through a pinned bounce buffer that `wait()` copies out of.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from splitserve.connector.layout.staging_format import BlockIds

DEFAULT_LIMIT_BYTES = 256 * 1024**2  # device buffers (and pinned bounce buffers) in flight


class HostCopyable(Protocol):
    """What a copier needs of a layer's layout: synchronous copies to and from host regions."""

    @property
    def bytes_per_token(self) -> int: ...

    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor
               ) -> None: ...

    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None: ...


class DeviceCopyable(HostCopyable, Protocol):
    """A device layout's copies between its cache and a staging region on the same device."""

    def gather_device(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor
                      ) -> None: ...

    def scatter_device(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                       region_start: int) -> None: ...


class Completion(ABC):
    @abstractmethod
    def done(self) -> bool:
        """Whether the copy is complete; never blocks."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the copy is complete (see the module contract)."""


class Done(Completion):
    """A copy that was complete when it was returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class Copier(ABC):
    def mark(self) -> Completion:
        """On the forward thread, after a layer's KV was written: what a copy made later on
        another thread (`layer.gather`) waits for first, so it reads the written KV."""
        return DONE

    @abstractmethod
    def save(self, layer: HostCopyable, block_ids: BlockIds, start: int, end: int,
             region: torch.Tensor) -> Completion | None:
        """Queue (or do) the copy of tokens [start, end) into the host `region`."""

    @abstractmethod
    def load(self, layer: HostCopyable, block_ids: BlockIds, start: int, end: int,
             region: torch.Tensor, region_start: int) -> Completion | None:
        """Queue (or do) the copy of tokens [start, end) from the host `region` (holding
        tokens [region_start, end)) into the blocks."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer this copier's copies are fastest from and into."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def register_host(self, region: torch.Tensor) -> bool:
        """Make an existing host buffer (D's staging segment) fast for this copier's copies;
        whether it now is. Unregistered buffers still work, through bounce buffers."""
        return False

    def unregister_host(self, region: torch.Tensor) -> None:
        return None


class InlineCopies(Copier):
    """The CPU engine's copier: every copy runs synchronously on the calling thread."""

    def save(self, layer: HostCopyable, block_ids: BlockIds, start: int, end: int,
             region: torch.Tensor) -> Completion:
        layer.gather(block_ids, start, end, region)
        return DONE

    def load(self, layer: HostCopyable, block_ids: BlockIds, start: int, end: int,
             region: torch.Tensor, region_start: int) -> Completion:
        layer.scatter(block_ids, start, end, region, region_start)
        return DONE


class InFlightBudget:
    """Bytes of buffers in flight, at most `limit` (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class _EventCompletion(Completion):
    """Complete when `event` has fired; `finish` (once, on the thread that observes it) copies
    a bounce buffer out and returns the budget."""

    def __init__(self, event: torch.cuda.Event, finish: Callable[[], None]) -> None:
        self._event = event
        self._finish: Callable[[], None] | None = finish
        self._lock = threading.Lock()

    def _settle(self) -> None:
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def done(self) -> bool:
        if self._finish is None:
            return True
        if not self._event.query():
            return False
        self._settle()
        return True

    def wait(self) -> None:
        if self._finish is not None:
            self._event.synchronize()
            self._settle()


class CudaCopies(Copier):
    """Side-stream copies for a CUDA engine. At most `limit_bytes` of device staging buffers
    (each paired with a pinned bounce buffer where the host region is not pinned) are in
    flight; the device buffers come from torch's caching allocator on the side stream, so a
    freed buffer is only reused by later work of that stream."""

    def __init__(self, device: torch.device, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.budget = InFlightBudget(limit_bytes)
        self._ranges: list[tuple[int, int]] = []  # (address, bytes) registered as pinned

    def _pinned(self, region: torch.Tensor) -> bool:
        if region.is_pinned():
            return True
        lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
        return any(a <= lo and hi <= a + n for a, n in self._ranges)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def register_host(self, region: torch.Tensor) -> bool:
        """Register through vLLM's own helper (`host_register`), which clears the CUDA error a
        refused registration leaves behind (else the next kernel launch's error check would
        raise it); without vLLM (the benchmark) nothing is registered."""
        try:
            from vllm.v1.kv_offload.cpu.host_register import host_register
        except ImportError:
            return False
        ptr, nbytes = region.data_ptr(), region.numel() * region.element_size()
        if not host_register(ptr, nbytes):
            return False
        self._ranges = [*self._ranges, (ptr, nbytes)]
        return True

    def unregister_host(self, region: torch.Tensor) -> None:
        ptr = region.data_ptr()
        if any(lo == ptr for lo, _ in self._ranges):
            from vllm.v1.kv_offload.cpu.host_register import host_unregister

            host_unregister(ptr)
            self._ranges = [(lo, n) for lo, n in self._ranges if lo != ptr]

    def mark(self) -> Completion:
        written = torch.cuda.Event(blocking=True)
        written.record(torch.cuda.current_stream(self.device))
        return _EventCompletion(written, lambda: None)

    def _after_compute(self) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)

    def save(self, layer: DeviceCopyable, block_ids: BlockIds,  # type: ignore[override]
             start: int, end: int, region: torch.Tensor) -> Completion | None:
        nbytes = region.numel()
        if not self.budget.take(nbytes):
            return None
        try:
            self._after_compute()
            bounce = None if self._pinned(region) else self.host_buffer(nbytes)
            with torch.cuda.stream(self.stream):
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                layer.gather_device(block_ids, start, end, buf)
                (region if bounce is None else bounce).copy_(buf, non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # waiters sleep, not spin
                done.record(self.stream)
        except BaseException:
            self.budget.give(nbytes)
            raise

        def finish() -> None:
            if bounce is not None:
                region.copy_(bounce)
            self.budget.give(nbytes)

        return _EventCompletion(done, finish)

    def load(self, layer: DeviceCopyable, block_ids: BlockIds,  # type: ignore[override]
             start: int, end: int, region: torch.Tensor, region_start: int
             ) -> Completion | None:
        nbytes = region.numel()
        if not self.budget.take(nbytes):
            return None
        try:
            src = region
            if not self._pinned(region):
                src = self.host_buffer(nbytes)
                src.copy_(region)  # a host memcpy on this thread; registering avoids it
            self._after_compute()
            with torch.cuda.stream(self.stream):
                buf = src.to(self.device, non_blocking=True)
                layer.scatter_device(block_ids, start, end, buf, region_start)
                done = torch.cuda.Event(blocking=True)  # waiters sleep, not spin
                done.record(self.stream)
        except BaseException:
            self.budget.give(nbytes)
            raise
        return _EventCompletion(done, lambda: self.budget.give(nbytes))
