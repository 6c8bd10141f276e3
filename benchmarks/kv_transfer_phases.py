"""Where the time of one shm KV transfer goes: each phase of the path timed alone, on the bytes of
`kv_transfer.py` (same KV shape, 128-token blocks, float32), beside the whole transfer.

Phases of one transfer (all layers):
- gather: P copies each layer's tokens out of its paged blocks into D's shared segment (the
  strided copy `VllmCpuLayout.gather`);
- checksum: P's xxh3 of each layer's region (the LAYER frame's);
- verify: D's xxh3 of each layer's region against the frame's (the same work again, on D);
- scatter: D's loader copies each layer's region into its own paged blocks;
- memcpy: one contiguous copy of the transfer's bytes (the ceiling counts two);
- whole: the shm transfer as `kv_transfer.py` times it (begin to the end of the scatter).
`rest` is what the whole transfer spends beyond gather, checksum, verify and scatter: frames,
the END/ACK round trip and the threads' wake-ups. `bound` is the best ratio a transfer that
keeps both checksums could reach: gather and scatter at memcpy speed, nothing else added
(ceiling / (ceiling + checksum + verify)); `bound_overlap` the same with D's verify wholly
hidden behind P's work (ceiling / (ceiling + checksum)).

Prints a table and writes JSON (default benchmarks/results/kv_transfer_phases.json). Timings are
reported, never asserted.

    python benchmarks/kv_transfer_phases.py [--reps 7] [--tokens 2048 8192] [--scattered]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_transfer import (  # noqa: E402
    BLOCK,
    FP,
    SHAPE,
    TOKEN,
    block_ids,
    open_d,
    ours,
    paged_caches,
    parse_args,
)

from splitserve.connector.faults import Faults  # noqa: E402
from splitserve.connector.layout.cpu import VllmCpuLayout  # noqa: E402
from splitserve.connector.layout.staging_format import region_offset  # noqa: E402
from splitserve.connector.segment import SharedSegment  # noqa: E402
from splitserve.connector.staging import StagingArea  # noqa: E402
from splitserve.connector.stats import ConnectorStats  # noqa: E402
from splitserve.connector.transport.shm import ShmPushChannel  # noqa: E402

PHASES = ("gather", "checksum", "verify", "scatter", "memcpy", "whole")


def median_s(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def phases(tokens: int, reps: int, segment: SharedSegment, ch: ShmPushChannel,
           staging: StagingArea, scattered: bool) -> dict[str, float]:
    src, dst = paged_caches(tokens, scattered), paged_caches(tokens, scattered)
    blocks, dst_blocks = block_ids(tokens, scattered, 1), block_ids(tokens, scattered, 2)
    nbytes = SHAPE.transfer_bytes(tokens)
    layer_bytes = SHAPE.layer_bytes(tokens)
    regions = [segment.tensor[region_offset(SHAPE, 0, tokens, layer):][:layer_bytes]
               for layer in range(SHAPE.num_layers)]
    flat = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8)

    def gather() -> None:
        for layer, cache in enumerate(src):
            VllmCpuLayout(cache).gather(blocks, 0, tokens, regions[layer])

    def checksum() -> None:
        for region in regions:
            xxhash.xxh3_64_hexdigest(memoryview(region.numpy()))

    def scatter() -> None:
        for layer, cache in enumerate(dst):
            VllmCpuLayout(cache).scatter(dst_blocks, 0, tokens, regions[layer], 0)

    def memcpy() -> None:
        segment.tensor[:nbytes].copy_(flat)
        flat_dst.copy_(segment.tensor[:nbytes])

    counter = iter(range(10**9))
    out = {"gather": median_s(gather, reps), "checksum": median_s(checksum, reps),
           "scatter": median_s(scatter, reps), "memcpy": median_s(memcpy, reps) / 2,
           "whole": median_s(lambda: ours(ch, tokens, staging, src, dst,
                                          f"phases-{tokens}-{next(counter)}", blocks,
                                          dst_blocks), reps)}
    out["verify"] = out["checksum"]  # the same bytes hashed the same way on D
    return out


def main() -> None:
    args = parse_args(__doc__, [2048, 8192], 7, "benchmarks/results/kv_transfer_phases.json")
    staging, listener, segment = open_d()
    ch = ShmPushChannel("127.0.0.1", listener.port, TOKEN, FP, ConnectorStats(), Faults(False),
                        SHAPE, 5.0)
    rows = []
    print(f"{'tokens':>7} {'MB':>6} " + " ".join(f"{p + ' ms':>11}" for p in PHASES)
          + f" {'rest ms':>8} {'ratio':>6} {'bound':>6} {'overlap':>8}")
    for tokens in args.tokens:
        t = phases(tokens, args.reps, segment, ch, staging, args.scattered)
        nbytes = SHAPE.transfer_bytes(tokens)
        rest = t["whole"] - t["gather"] - t["checksum"] - t["verify"] - t["scatter"]
        ceiling = 2 * t["memcpy"]
        bound = ceiling / (ceiling + t["checksum"] + t["verify"])
        bound_overlap = ceiling / (ceiling + t["checksum"])
        rows.append({"tokens": tokens, "bytes": nbytes, **{f"{p}_s": t[p] for p in PHASES},
                     "rest_s": rest, "ceiling_s": ceiling, "ratio": ceiling / t["whole"],
                     "bound": bound, "bound_overlap": bound_overlap,
                     "gbps": {p: nbytes / t[p] / 1e9 for p in PHASES}, "reps": args.reps})
        print(f"{tokens:>7} {nbytes / 1e6:>6.1f} "
              + " ".join(f"{t[p] * 1e3:>11.2f}" for p in PHASES)
              + f" {rest * 1e3:>8.2f} {ceiling / t['whole']:>6.2f} {bound:>6.2f}"
              + f" {bound_overlap:>8.2f}")
    ch.close()
    listener.close()
    staging.close()
    segment.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": {"num_layers": SHAPE.num_layers,
                                         "num_kv_heads": SHAPE.num_kv_heads,
                                         "head_dim": SHAPE.head_dim, "dtype": "float32"},
                               "block_size": BLOCK, "scattered": args.scattered,
                               "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
