"""A measured NIXL link for the profile: time NIXL READs between two agents on this host.

What it measures is NIXL's transport (UCX, as vLLM's NixlConnector builds its agents), DRAM to
DRAM between two local processes, loopback: a "P" process registers a source buffer and hands
its agent metadata over a pipe; a "D" process registers a destination buffer, loads P's
metadata and READs from it, as a NixlConnector D pulls a finished request's blocks. Each
transfer is a list of `desc_bytes` descriptors (one per KV block and layer on vLLM-CPU: block
size × kv heads × head dim × dtype bytes), timed from posting to DONE. Both agents run their
progress thread with splitserve's worker delay (`NIXL_PROGRESS_DELAY_US`). It is not the
connector's whole pull (no side-channel handshake, no vLLM scheduler step, no notification):
`splitserve.sim` adds D's request round trip and step boundaries to the transfer it fits.

Per size, the fastest of `repeats` READs (a busy machine only ever adds time); every READ's
bytes are checked against P's pattern; then `time = bytes / bandwidth + latency` is fitted
(`costmodel.fit_link`).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from splitserve.config import NIXL_PROGRESS_DELAY_US
from splitserve.sim.costmodel import TransferLink, fit_link_or_span

PROBE_SIZES: tuple[int, ...] = (1 << 18, 1 << 20, 1 << 22, 1 << 24)
DESC_BYTES = 1 << 16  # 128 tokens × 2 kv heads × 64 × 4 B: the demo model's block per layer


def _agent(name: str, progress_delay_us: int) -> Any:
    """A NIXL agent with UCX, its progress thread polling every `progress_delay_us` (nixl's
    Python API would build it with 0: a busy spin)."""
    import nixl._api as api

    build = api.nixlBind.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = progress_delay_us
        return build(agent_name, config)

    api.nixlBind.nixlAgent = with_delay
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    finally:
        api.nixlBind.nixlAgent = build


def pattern(nbytes: int) -> np.ndarray:
    """The bytes P serves: position-dependent, so a misplaced or missing block shows."""
    return (np.arange(nbytes, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)


def _serve(conn: Connection, nbytes: int, progress_delay_us: int) -> None:
    """P: register a buffer with the pattern, send (metadata, address), wait for "done"."""
    agent = _agent("splitserve-probe-P", progress_delay_us)
    src = pattern(nbytes)
    agent.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), src.ctypes.data))
    conn.recv()


def _descs(base: int, nbytes: int, desc_bytes: int) -> np.ndarray:
    n = max(1, nbytes // desc_bytes)
    starts = base + np.arange(n, dtype=np.int64) * desc_bytes
    return np.stack([starts, np.full(n, min(desc_bytes, nbytes), dtype=np.int64),
                     np.zeros(n, dtype=np.int64)], axis=1)


def measure_reads(sizes: tuple[int, ...] = PROBE_SIZES, desc_bytes: int = DESC_BYTES,
                  repeats: int = 5, progress_delay_us: int = NIXL_PROGRESS_DELAY_US,
                  timeout_s: float = 60.0) -> dict[int, float]:
    """Bytes → the fastest READ's seconds, over `repeats` READs of each size by a D agent from
    a P agent. Raises RuntimeError if a READ fails, times out or delivers wrong bytes.

    Both agents live in child processes, never in this one: a process that built a NIXL agent
    crashed at its exit here (SIGSEGV; nixl 1.5.1 with UCX), which made `splitserve profile
    --nixl-probe` exit 139 after it had written the profile."""
    if not sizes or min(sizes) < desc_bytes or desc_bytes < 1 or repeats < 1:
        raise ValueError("need sizes >= desc_bytes >= 1 and repeats >= 1")
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited UCX or engine state
    to_p, p_end = ctx.Pipe()
    to_d, d_end = ctx.Pipe()
    p = ctx.Process(target=_serve, args=(p_end, max(sizes), progress_delay_us), daemon=True)
    d = ctx.Process(target=_read, args=(d_end, sizes, desc_bytes, repeats, progress_delay_us,
                                        timeout_s), daemon=True)
    p.start()
    d.start()
    try:
        if not to_p.poll(timeout_s):
            raise RuntimeError("nixl probe: P's agent did not start")
        to_d.send(to_p.recv())  # P's metadata and buffer address
        deadline = time.monotonic() + timeout_s * (1 + len(sizes) * repeats)  # a READ each
        while not to_d.poll(0.2):
            if not d.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("nixl probe: D's agent ended or hung before its READs did")
        status, result = to_d.recv()
        to_p.send("done")
    finally:
        join_or_kill(d, p)
    if status != "ok":
        raise RuntimeError(result)
    return result


def join_or_kill(*children: BaseProcess) -> None:
    """Wait up to 10 s for each probe child to end, then kill it."""
    for child in children:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()


def _read(conn: Connection, sizes: tuple[int, ...], desc_bytes: int, repeats: int,
          progress_delay_us: int, timeout_s: float) -> None:
    """D: wait for P's (metadata, address), READ, send ("ok", bytes → seconds) or ("error",
    why)."""
    meta, src_base = conn.recv()
    try:
        conn.send(("ok", _read_from(meta, src_base, sizes, desc_bytes, repeats,
                                    progress_delay_us, timeout_s)))
    except Exception as exc:  # any failure is the caller's RuntimeError
        conn.send(("error", f"nixl probe: {exc!r}" if not isinstance(exc, RuntimeError)
                   else str(exc)))


def _read_from(meta: bytes, src_base: int, sizes: tuple[int, ...], desc_bytes: int,
               repeats: int, progress_delay_us: int, timeout_s: float) -> dict[int, float]:
    """D's READs; its agent is torn down before this returns (peer removed, memory
    deregistered)."""
    agent = _agent("splitserve-probe-D", progress_delay_us)
    dst = np.zeros(max(sizes), dtype=np.uint8)
    registered = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    try:
        want = pattern(dst.nbytes)
        best: dict[int, float] = {}
        for n in [n for n in sizes for _ in range(repeats)]:
            n = n // desc_bytes * desc_bytes
            dst[:n] = 0
            local = agent.get_xfer_descs(_descs(dst.ctypes.data, n, desc_bytes), "DRAM")
            remote = agent.get_xfer_descs(_descs(src_base, n, desc_bytes), "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, peer)
            deadline = time.perf_counter() + timeout_s
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC" and time.perf_counter() < deadline:
                state = agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - t0
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl probe: a READ of {n} bytes ended {state}")
            if not np.array_equal(dst[:n], want[:n]):
                raise RuntimeError(f"nixl probe: a READ of {n} bytes delivered wrong bytes")
            best[n] = min(best.get(n, float("inf")), elapsed)
        return best
    finally:
        agent.remove_remote_agent(peer)
        agent.deregister_memory(registered)


def probe_nixl(sizes: tuple[int, ...] = PROBE_SIZES, desc_bytes: int = DESC_BYTES,
               repeats: int = 5, progress_delay_us: int = NIXL_PROGRESS_DELAY_US
               ) -> TransferLink:
    """The `nixl` link of a profile: `measure_reads` fitted to bytes / bandwidth + latency,
    labelled with what it measured."""
    best = measure_reads(sizes, desc_bytes, repeats, progress_delay_us)
    source = (f"nixl probe of this host: UCX READ DRAM->DRAM between two local processes, "
              f"{desc_bytes} B descriptors, progress delay {progress_delay_us} us "
              "(the transport, not the connector's whole pull)")
    return fit_link_or_span(best, source)
