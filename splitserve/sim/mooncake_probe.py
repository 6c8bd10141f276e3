"""A measured Mooncake link for the profile: time WRITEs of Mooncake's transfer engine between
two engines on this host.

What it measures is the engine as vLLM's MooncakeConnector builds it (`initialize(host,
"P2PHANDSHAKE", protocol, "")`), DRAM to DRAM between two local processes, loopback: a "D"
process registers a destination buffer and hands its session (`host:rpc_port`) and address over
a pipe; a "P" process registers a source buffer holding a pattern and writes into D's with
`batch_transfer_sync_write`, one entry per KV block and layer. That is the connector sender's
most fragmented write: it merges runs of blocks contiguous on both sides into one entry, so a
write of whole fresh caches may take fewer, larger entries than this. Each write is timed from
the call to its return (the tcp transport returns once D acknowledged it), and D checks its
bytes. It is not the connector's whole handover (no bootstrap query, no request from
D, no wait for P's next engine step): `splitserve.sim` adds D's leg and P's step boundary to
the transfer it fits.

Per size, the fastest of `repeats` writes (a busy machine only ever adds time); then `time =
bytes / bandwidth + latency` is fitted (`costmodel.fit_link`).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from splitserve.sim.costmodel import TransferLink, fit_link_or_span
from splitserve.sim.nixl_probe import DESC_BYTES, PROBE_SIZES, join_or_kill, pattern

HOST = "127.0.0.1"


def _engine(protocol: str) -> Any:
    """An engine initialised as vLLM's MooncakeConnector initialises its own."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") != 0:
        raise RuntimeError(f"mooncake probe: the transfer engine did not initialise ({protocol})")
    return engine


def _registered(engine: Any, buf: np.ndarray) -> None:
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError(f"mooncake probe: registering {buf.nbytes} bytes failed")


def _d_side(conn: Connection, nbytes: int, protocol: str) -> None:
    """D: register a destination buffer, send ("ok", (session, address)); then answer "zero n"
    (clear its first n bytes) and "check n" (are they P's pattern?) until "stop"."""
    try:
        engine = _engine(protocol)
        dst = np.zeros(nbytes, dtype=np.uint8)
        _registered(engine, dst)
        want = pattern(nbytes)
        conn.send(("ok", (f"{HOST}:{engine.get_rpc_port()}", dst.ctypes.data)))
        while (msg := conn.recv())[0] != "stop":
            what, n = msg
            if what == "zero":
                dst[:n] = 0
                conn.send(("ok", None))
            else:
                conn.send(("ok", bool(np.array_equal(dst[:n], want[:n]))))
        engine.unregister_memory(dst.ctypes.data)
    except Exception as exc:  # the caller's RuntimeError
        conn.send(("error", str(exc) if isinstance(exc, RuntimeError)
                   else f"mooncake probe: {exc!r}"))


def _p_side(conn: Connection, nbytes: int, desc_bytes: int, protocol: str) -> None:
    """P: register a source buffer holding the pattern, send ("ok", None); take D's (session,
    address), then answer "write n" (entries of `desc_bytes`) with the write's seconds until
    "stop"."""
    try:
        engine = _engine(protocol)
        src = pattern(nbytes)
        _registered(engine, src)
        conn.send(("ok", None))
        session, dst_base = conn.recv()
        while (msg := conn.recv())[0] != "stop":
            _, n = msg
            offsets = list(range(0, n, desc_bytes))
            lengths = [min(desc_bytes, n - o) for o in offsets]
            srcs = [src.ctypes.data + o for o in offsets]
            dsts = [dst_base + o for o in offsets]
            t0 = time.perf_counter()
            ret = engine.batch_transfer_sync_write(session, srcs, dsts, lengths)
            elapsed = time.perf_counter() - t0
            if ret != 0:
                raise RuntimeError(f"mooncake probe: a write of {n} bytes returned {ret}")
            conn.send(("ok", elapsed))
        engine.unregister_memory(src.ctypes.data)
    except Exception as exc:  # the caller's RuntimeError
        conn.send(("error", str(exc) if isinstance(exc, RuntimeError)
                   else f"mooncake probe: {exc!r}"))


def _ask(conn: Connection, child: BaseProcess, msg: Any, timeout_s: float, who: str) -> Any:
    """Send `msg` (None: only wait) and return the child's ("ok", answer)'s answer;
    RuntimeError if it ends, fails or does not answer within `timeout_s`."""
    if msg is not None:
        conn.send(msg)
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if (not child.is_alive() and not conn.poll(0)) or time.monotonic() > deadline:
            raise RuntimeError(f"mooncake probe: {who}'s engine ended or hung")
    status, answer = conn.recv()
    if status != "ok":
        raise RuntimeError(answer)
    return answer


def measure_writes(sizes: tuple[int, ...] = PROBE_SIZES, desc_bytes: int = DESC_BYTES,
                   repeats: int = 5, protocol: str = "tcp", timeout_s: float = 60.0
                   ) -> dict[int, float]:
    """Bytes → the fastest write's seconds, over `repeats` writes of each size from a P engine
    into a D engine. Raises RuntimeError if an engine fails, a write fails or times out, or D
    finds other bytes than P's. Both engines live in spawned child processes, as the NIXL
    probe's agents do: this process builds none."""
    if not sizes or min(sizes) < desc_bytes or desc_bytes < 1 or repeats < 1:
        raise ValueError("need sizes >= desc_bytes >= 1 and repeats >= 1")
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited engine state
    to_p, p_end = ctx.Pipe()
    to_d, d_end = ctx.Pipe()
    p = ctx.Process(target=_p_side, args=(p_end, max(sizes), desc_bytes, protocol),
                    daemon=True)
    d = ctx.Process(target=_d_side, args=(d_end, max(sizes), protocol), daemon=True)
    p.start()
    d.start()
    best: dict[int, float] = {}
    try:
        session, dst_base = _ask(to_d, d, None, timeout_s, "D")
        _ask(to_p, p, None, timeout_s, "P")
        to_p.send((session, dst_base))
        for n in [n // desc_bytes * desc_bytes for n in sizes for _ in range(repeats)]:
            _ask(to_d, d, ("zero", n), timeout_s, "D")
            elapsed = _ask(to_p, p, ("write", n), timeout_s, "P")
            if not _ask(to_d, d, ("check", n), timeout_s, "D"):
                raise RuntimeError(f"mooncake probe: a write of {n} bytes delivered wrong bytes")
            best[n] = min(best.get(n, float("inf")), elapsed)
    finally:
        for conn, child in ((to_p, p), (to_d, d)):
            if child.is_alive():
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
        join_or_kill(p, d)
    return best


def probe_mooncake(sizes: tuple[int, ...] = PROBE_SIZES, desc_bytes: int = DESC_BYTES,
                   repeats: int = 5, protocol: str = "tcp") -> TransferLink:
    """The `mooncake` link of a profile: `measure_writes` fitted to bytes / bandwidth +
    latency, labelled with what it measured."""
    best = measure_writes(sizes, desc_bytes, repeats, protocol)
    source = (f"mooncake probe of this host: transfer-engine WRITE DRAM->DRAM over {protocol} "
              f"between two local processes, {desc_bytes} B entries "
              "(the engine, not the connector's whole handover)")
    return fit_link_or_span(best, source)
