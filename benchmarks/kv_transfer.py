"""KV transfer throughput of each transport against the ceiling of the same bytes.

For prompts of 128..8,192 tokens on the embedded model's KV shape (8 layers, 2 KV heads,
head_dim 64, float32, 128-token blocks), one transfer is: P's channel pushes every layer (gather
from P's blocks + checksum + transport), D's listener stages and verifies it, D's loader copies
it into its own blocks. Timed from `begin` to the end of the copy into D's blocks.

`--scattered`: each request's blocks lie anywhere in a four times larger cache, in no order, as
in a worker whose cache has turned over (default: consecutive blocks from 0).

`--two-process`: D (listener, staging, the copy into its blocks) runs in a child process, as in a
deployment, so P's and D's threads do not share one interpreter lock. D copies into its blocks as
soon as the transfer is complete (without waiting for P to read the ACK), and the time runs from
P's `begin` to the end of that copy, both read on the host's monotonic clock. Default: both sides
in this process, timed to D's copy after P has read the ACK.

Ceilings, measured in the same run on the same bytes with the fewest copies the path needs:
- tcp: a raw loopback socket send of a preallocated buffer into a preallocated buffer, plus one
  memcpy into blocks;
- shm: one memcpy into a shared-memory segment plus one memcpy into blocks.

Prints a table and writes JSON (default benchmarks/results/kv_transfer.json, with
`--two-process` kv_transfer_two_process.json). Timings are reported, never asserted.

    python benchmarks/kv_transfer.py [--reps 5] [--tokens 128 512 2048 8192] [--scattered]
        [--two-process]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import socket
import statistics
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from splitserve.common.vocab import TransferStatus
from splitserve.connector.faults import Faults
from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.layout.staging_format import KVShape, region_offset
from splitserve.connector.listener import KVListener
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.segment import SharedSegment
from splitserve.connector.staging import StagedTransfer, StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.items import LayerItem
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel

TOKEN = "benchmark-token-0123456789abcdef"
SHAPE = KVShape(num_layers=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
BLOCK = 128
FP = Fingerprint("bench", "float32", 8, 2, 64, "0.32.0")


DEFAULT_OUT = "benchmarks/results/kv_transfer.json"  # --two-process: kv_transfer_two_process.json
SPREAD = 4  # --scattered: a request's blocks among this many times as many


def paged_caches(tokens: int, scattered: bool = False) -> list[torch.Tensor]:
    blocks = -(-tokens // BLOCK) * SPREAD if scattered else -(-tokens // BLOCK) + 1
    return [torch.randn(blocks, SHAPE.num_kv_heads, BLOCK, 2 * SHAPE.head_dim)
            for _ in range(SHAPE.num_layers)]


def block_ids(tokens: int, scattered: bool = False, seed: int = 0) -> tuple[int, ...]:
    """A request's block ids: 0, 1, 2... or (`scattered`) anywhere in `paged_caches`'s."""
    n = -(-tokens // BLOCK)
    return tuple(random.Random(seed).sample(range(n * SPREAD), n) if scattered else range(n))


def push(ch: PushChannel, tid: str, tokens: int, src: list[torch.Tensor],
         blocks: tuple[int, ...]) -> None:
    """P's side: BEGIN, every layer of tokens [0, tokens) out of `blocks`, END."""
    ch.begin(tid, tokens, SHAPE.transfer_bytes(tokens), 30.0)
    for layer, cache in enumerate(src):
        ch.push_layer(LayerItem(tid, layer, 0, tokens, VllmCpuLayout(cache), blocks))
    ch.end(tid)


def acked(ch: PushChannel, tid: str) -> None:
    """Wait for D's ACK of `tid`; it must say complete."""
    while not (st := ch.poll(tid)).settled:
        time.sleep(0.0002)
    assert st.status == TransferStatus.COMPLETE, st.status


def load(staging: StagingArea, staged: StagedTransfer, tokens: int, dst: list[torch.Tensor],
         dst_blocks: tuple[int, ...]) -> None:
    """D's loader: every layer from the staging segment into D's blocks."""
    nbytes = tokens * SHAPE.bytes_per_token_layer
    for layer, cache in enumerate(dst):
        base = staged.offset + region_offset(SHAPE, 0, tokens, layer)
        VllmCpuLayout(cache).scatter(dst_blocks, 0, tokens,
                                     staging.segment.tensor[base:base + nbytes], 0)


def ours(ch: PushChannel, tokens: int, staging: StagingArea, src: list[torch.Tensor],
         dst: list[torch.Tensor], tid: str, blocks: tuple[int, ...], dst_blocks: tuple[int, ...]
         ) -> float:
    """One transfer on a connected channel (as in a running worker), timed to D's blocks."""
    t0 = time.perf_counter()
    push(ch, tid, tokens, src, blocks)
    acked(ch, tid)
    staged = staging.claim(tid)
    assert staged is not None and staged.complete
    load(staging, staged, tokens, dst, dst_blocks)
    elapsed = time.perf_counter() - t0
    staging.release(staged, "loaded")
    return elapsed


def d_process(conn: Connection, scattered: bool) -> None:
    """D in its own process: sends its listener's port, then for each `(transfer_id, tokens)`
    it is sent, waits for the transfer to complete, copies it into its blocks and answers the
    monotonic time the copy ended (None: the transfer failed or did not complete in 30 s);
    `None` ends it."""
    torch.set_num_threads(1)
    staging, listener, segment = open_d()
    conn.send(listener.port)
    caches: dict[int, list[torch.Tensor]] = {}
    while (job := conn.recv()) is not None:
        tid, tokens = job
        if tokens not in caches:
            caches[tokens] = paged_caches(tokens, scattered)
        dst = caches[tokens]
        dst_blocks = block_ids(tokens, scattered, 2)
        deadline, staged = time.monotonic() + 30.0, None
        while time.monotonic() < deadline:
            staged = staging.claim(tid)
            if staged is not None and (staged.complete or staged.failed):
                break
            time.sleep(0.0002)
        if staged is None or not staged.complete:
            conn.send(None)
            continue
        load(staging, staged, tokens, dst, dst_blocks)
        conn.send(time.perf_counter())
        staging.release(staged, "loaded")
    listener.close()
    staging.close()
    segment.close()


def ours_apart(ch: PushChannel, tokens: int, src: list[torch.Tensor], tid: str,
               blocks: tuple[int, ...], d: Connection) -> float:
    """One transfer to D in its own process (`d_process`), timed to the end of D's copy."""
    d.send((tid, tokens))
    t0 = time.perf_counter()
    push(ch, tid, tokens, src, blocks)
    if not d.poll(60.0):
        raise RuntimeError("D's process did not answer in 60 s")
    end = d.recv()
    if end is None:
        raise RuntimeError(f"transfer {tid} failed or did not complete on D")
    acked(ch, tid)
    return end - t0


def tcp_ceiling(nbytes: int, blocks_dst: torch.Tensor) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    recv_buf = torch.empty(nbytes, dtype=torch.uint8)
    send_buf = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(recv_buf.numpy()), 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.close()
        done.set()

    threading.Thread(target=receive, daemon=True).start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    client.sendall(memoryview(send_buf.numpy()))
    done.wait()
    blocks_dst[:nbytes].copy_(recv_buf)
    elapsed = time.perf_counter() - t0
    client.close()
    server.close()
    return elapsed


def shm_ceiling(nbytes: int, blocks_dst: torch.Tensor, segment: SharedSegment) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    t0 = time.perf_counter()
    segment.tensor[:nbytes].copy_(src)
    blocks_dst[:nbytes].copy_(segment.tensor[:nbytes])
    return time.perf_counter() - t0


def parse_args(doc: str, tokens: list[int], reps: int, out: str) -> argparse.Namespace:
    """`--tokens`, `--reps` and `--out`, with these defaults; one compute thread from here."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=tokens)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out", default=out)
    ap.add_argument("--scattered", action="store_true",
                    help="blocks anywhere in a 4x larger cache, in no order")
    ap.add_argument("--two-process", action="store_true",
                    help="D in a child process, as in a deployment (default: one process)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    return args


def open_d() -> tuple[StagingArea, KVListener, SharedSegment]:
    """D's staging and listener in this process, and a segment for the ceiling's copies."""
    staging = StagingArea(256 * 1024**2, SHAPE, lease_s=60.0, stats=ConnectorStats())
    listener = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {})
    return staging, listener, SharedSegment(256 * 1024**2)


def main() -> None:
    args = parse_args(__doc__, [128, 512, 2048, 4096, 8192], 5, DEFAULT_OUT)
    staging, listener, segment = open_d()
    port, d_conn, child = listener.port, None, None
    if args.two_process:
        d_conn, child_conn = multiprocessing.Pipe()
        child = multiprocessing.get_context("spawn").Process(
            target=d_process, args=(child_conn, args.scattered), daemon=True)
        child.start()
        child_conn.close()  # D's end lives in D: its exit is EOF here
        port = d_conn.recv()
    channels: dict[str, PushChannel] = {
        kind: cls("127.0.0.1", port, TOKEN, FP, ConnectorStats(), Faults(False), SHAPE,
                  5.0)
        for kind, cls in (("tcp", TcpPushChannel), ("shm", ShmPushChannel))
    }
    rows = []
    print(f"{'tokens':>7} {'MB':>7} {'transport':>9} {'ours GB/s':>10} {'ceiling GB/s':>13} "
          f"{'ratio':>6}")
    for tokens in args.tokens:
        nbytes = SHAPE.transfer_bytes(tokens)
        src, dst = paged_caches(tokens, args.scattered), paged_caches(tokens, args.scattered)
        blocks = block_ids(tokens, args.scattered, 1), block_ids(tokens, args.scattered, 2)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8)
        for kind in ("tcp", "shm"):
            ch = channels[kind]
            one = (partial(ours_apart, ch, tokens, src, blocks=blocks[0], d=d_conn)
                   if d_conn is not None  # D's blocks and their ids are in its process
                   else partial(ours, ch, tokens, staging, src, dst, blocks=blocks[0],
                                dst_blocks=blocks[1]))
            one(tid=f"warm-{kind}-{tokens}")  # untimed
            mine, ceil = [], []
            for rep in range(args.reps):  # interleaved: ours, ceiling, ours, ceiling...
                mine.append(one(tid=f"{kind}-{tokens}-{rep}"))
                ceil.append(tcp_ceiling(nbytes, flat_dst) if kind == "tcp"
                            else shm_ceiling(nbytes, flat_dst, segment))
            gb_ours = nbytes / statistics.median(mine) / 1e9
            gb_ceil = nbytes / statistics.median(ceil) / 1e9
            rows.append({"tokens": tokens, "bytes": nbytes, "transport": kind,
                         "median_s": statistics.median(mine), "gbps": gb_ours,
                         "ceiling_median_s": statistics.median(ceil), "ceiling_gbps": gb_ceil,
                         "ratio": gb_ours / gb_ceil, "reps": args.reps})
            print(f"{tokens:>7} {nbytes / 1e6:>7.1f} {kind:>9} {gb_ours:>10.2f} {gb_ceil:>13.2f} "
                  f"{gb_ours / gb_ceil:>6.2f}")
    for ch in channels.values():
        ch.close()
    if d_conn is not None and child is not None:
        d_conn.send(None)
        child.join(10)
    listener.close()
    staging.close()
    segment.close()
    out = Path(args.out if not args.two_process or args.out != DEFAULT_OUT
               else DEFAULT_OUT.replace(".json", "_two_process.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": SHAPE.__dict__ | {"dtype": "float32"},
                               "block_size": BLOCK, "scattered": args.scattered,
                               "two_process": args.two_process, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
