"""The connector's device path on one GPU: vLLM's CUDA KV layouts to host staging and back.

On Llama-3-8B's KV shape (32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks) at 2k,
8k and 32k tokens, for every vLLM 0.32 standard-attention layout (`layout.strided.LAYOUTS`), with
random block tables on both sides:

- round trip: P's cache -> pinned host (the staging format) -> D's cache, through the
  connector's own copier (`devcopy.CudaCopies`, bounded buffers), checked bit-exact block by
  block against P's cache, and layer 0's staging bytes against the same gather on the CPU;
- save GB/s (gather on the GPU + device-to-host, all layers, pipelined as P's forward issues
  them) against a plain device-to-host copy of the same bytes from one contiguous buffer;
  load GB/s (host-to-device + scatter) against a plain host-to-device copy;
- overlap: a stand-in forward pass (bf16 matmuls per layer on the compute stream) timed alone,
  and with each layer's save issued after it as P does; saves run on the side stream.

Target: save and load >= 80 % of the plain copy. Prints a table and writes JSON (default
benchmarks/results/gpu_kv.json). Needs torch only (no vLLM): `splitserve.connector.layout.strided`
and `devcopy` import nothing else. `--device cpu --small` runs a reduced shape on the CPU with
the inline copier (what `make test`'s machines can run; its numbers say nothing about GPUs).

    python benchmarks/gpu_kv.py                       # one CUDA GPU, a few minutes
    python benchmarks/gpu_kv.py --device cpu --small  # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's splitserve, on a machine that has only torch

from splitserve.connector.devcopy import (  # noqa: E402
    Completion,
    Copier,
    CudaCopies,
    InlineCopies,
)
from splitserve.connector.layout.strided import LAYOUTS, StridedKV, allocate_views  # noqa: E402


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


LLAMA3_8B = Shape(32, 8, 128, 16, torch.bfloat16)
SMALL = Shape(4, 8, 128, 16, torch.bfloat16)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:  # noqa: ANN001
    """Median seconds of `fn()` over `reps` runs after one warm-up, device work included."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def host_buffer(copier: Copier, nbytes: int) -> torch.Tensor:
    return copier.host_buffer(nbytes)


def run_all(copier: Copier, op, layers: int) -> None:  # noqa: ANN001
    """Issue `op(layer)` for every layer as the forward pass would, waiting for the oldest
    copy only when the copier's buffers are all in flight (what P's sender thread does)."""
    pending: deque[Completion] = deque()
    for layer in range(layers):
        while (c := op(layer)) is None:
            pending.popleft().wait()
        pending.append(c)
    while pending:
        pending.popleft().wait()


def bench_layout(name: str, shape: Shape, tokens: int, copier: Copier, device: torch.device,
                 reps: int, seed: int) -> dict[str, object]:
    bs = shape.block_size
    nblk = -(-tokens // bs)
    total_blocks = nblk + nblk // 4 + 1
    rng = random.Random(seed)
    p_views = allocate_views(name, shape.layers, total_blocks, shape.kv_heads, bs,
                             shape.head_dim, shape.dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for v in p_views:
        v.copy_(torch.randn(v.shape, generator=gen, device=device, dtype=torch.float32
                            ).to(shape.dtype))
    d_views = allocate_views(name, shape.layers, total_blocks, shape.kv_heads, bs,
                             shape.head_dim, shape.dtype, device)
    p_ids = rng.sample(range(total_blocks), nblk)
    d_ids = rng.sample(range(total_blocks), nblk)
    p_layers = [StridedKV(v) for v in p_views]
    d_layers = [StridedKV(v) for v in d_views]
    layer_bytes = tokens * shape.bytes_per_token_layer
    total = layer_bytes * shape.layers
    staging = host_buffer(copier, total)
    regions = [staging[i * layer_bytes:(i + 1) * layer_bytes] for i in range(shape.layers)]

    def save() -> None:
        run_all(copier, lambda i: copier.save(p_layers[i], p_ids, 0, tokens, regions[i]),
                shape.layers)

    def load() -> None:
        run_all(copier, lambda i: copier.load(d_layers[i], d_ids, 0, tokens, regions[i], 0),
                shape.layers)

    save()
    load()
    sync(device)
    full, tail = divmod(tokens, bs)
    p_idx = torch.tensor(p_ids, device=device)
    d_idx = torch.tensor(d_ids, device=device)
    exact = True
    for p_view, d_view in zip(p_views, d_views, strict=True):
        exact = exact and torch.equal(p_view[p_idx[:full]], d_view[d_idx[:full]])
        if tail:
            exact = exact and torch.equal(p_view[p_ids[-1], :, :tail], d_view[d_ids[-1], :, :tail])

    # the staging bytes themselves, against the same gather run on a CPU copy of layer 0
    ref = torch.empty(layer_bytes, dtype=torch.uint8)
    StridedKV(p_views[0].cpu()).gather(p_ids, 0, tokens, ref)
    staging_exact = torch.equal(ref, regions[0])

    flat_dev = torch.empty(total, dtype=torch.uint8, device=device)
    t_d2h = timed(lambda: staging.copy_(flat_dev, non_blocking=True), device, reps)
    t_h2d = timed(lambda: flat_dev.copy_(staging, non_blocking=True), device, reps)
    t_save = timed(save, device, reps)
    t_load = timed(load, device, reps)
    gb = total / 1e9
    return {"layout": name, "tokens": tokens, "bytes": total, "bit_exact": exact,
            "staging_matches_cpu": staging_exact,
            "plain_d2h_gbs": gb / t_d2h, "save_gbs": gb / t_save, "save_vs_plain": t_d2h / t_save,
            "plain_h2d_gbs": gb / t_h2d, "load_gbs": gb / t_load, "load_vs_plain": t_h2d / t_load,
            "save_s": t_save, "load_s": t_load}


def bench_overlap(shape: Shape, tokens: int, copier: Copier, device: torch.device, reps: int,
                  matmul_n: int, per_layer: int) -> dict[str, object]:
    """A stand-in forward: `per_layer` [n x n] bf16 matmuls per layer on the compute stream,
    each layer's save queued right after it (LBNHC, random blocks)."""
    bs = shape.block_size
    nblk = -(-tokens // bs)
    views = allocate_views("LBNHC", shape.layers, nblk + 1, shape.kv_heads, bs, shape.head_dim,
                           shape.dtype, device)
    layers = [StridedKV(v) for v in views]
    ids = random.Random(7).sample(range(nblk + 1), nblk)
    layer_bytes = tokens * shape.bytes_per_token_layer
    staging = host_buffer(copier, layer_bytes * shape.layers)
    regions = [staging[i * layer_bytes:(i + 1) * layer_bytes] for i in range(shape.layers)]
    a = torch.randn((matmul_n, matmul_n), device=device, dtype=torch.bfloat16)
    b = torch.randn((matmul_n, matmul_n), device=device, dtype=torch.bfloat16)

    def forward(with_saves: bool) -> None:
        pending: deque[Completion] = deque()
        for layer in range(shape.layers):
            for _ in range(per_layer):
                torch.mm(a, b)
            if with_saves:
                while (c := copier.save(layers[layer], ids, 0, tokens, regions[layer])) is None:
                    pending.popleft().wait()
                pending.append(c)
        while pending:
            pending.popleft().wait()

    def saves_only() -> None:
        run_all(copier, lambda i: copier.save(layers[i], ids, 0, tokens, regions[i]),
                shape.layers)

    t_mm = timed(lambda: forward(False), device, reps)
    t_sv = timed(saves_only, device, reps)
    t_both = timed(lambda: forward(True), device, reps)
    hidden = (t_mm + t_sv - t_both) / min(t_mm, t_sv) if min(t_mm, t_sv) > 0 else 0.0
    return {"tokens": tokens, "matmul_s": t_mm, "saves_s": t_sv, "matmul_with_saves_s": t_both,
            "forward_slowdown": t_both / t_mm, "overlap_fraction": max(0.0, min(1.0, hidden))}


def attempt(fn: Callable[[], dict[str, object]], what: dict[str, object]) -> dict[str, object]:
    """One measurement; an exception (out of memory, a CUDA error) is recorded in its row and
    the run goes on, so a single run on a borrowed GPU still reports everything it could."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {**what, "error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a reduced shape (CPU smoke run)")
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--limit-mib", type=int, default=256, help="copier buffers in flight")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_kv.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = SMALL if args.small else LLAMA3_8B
    tokens = args.tokens or ([256, 2048] if args.small else [2048, 8192, 32768])
    if device.type == "cuda":
        copier: Copier = CudaCopies(device, args.limit_mib * 1024**2)
        env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "cuda": torch.version.cuda}
    else:
        copier = InlineCopies()
        env = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    rows: list[dict[str, object]] = []
    print(f"{'layout':7} {'tokens':>6} {'MiB':>7} {'exact':>5} {'D2H':>7} {'save':>7} {'%':>4} "
          f"{'H2D':>7} {'load':>7} {'%':>4}   (GB/s)")
    overlap: list[dict[str, object]] = []

    def write() -> tuple[bool, bool]:
        """The JSON so far (rewritten after every measurement); (all bit-exact, all >= 80 %)."""
        ok = all(not r.get("error") and r["bit_exact"] and r["staging_matches_cpu"] for r in rows)
        meets = all(not r.get("error") and r["save_vs_plain"] >= 0.8
                    and r["load_vs_plain"] >= 0.8 for r in rows)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "env": env, "device": str(device),
            "shape": {**asdict(shape), "dtype": str(shape.dtype)}, "limit_mib": args.limit_mib,
            "reps": args.reps, "layouts": rows, "overlap": overlap, "all_bit_exact": ok,
            "meets_80_percent": meets}, indent=2))
        return ok, meets

    for n in tokens:
        for name in args.layouts:
            r = attempt(partial(bench_layout, name, shape, n, copier, device, args.reps, seed=n),
                        {"layout": name, "tokens": n})
            rows.append(r)
            if r.get("error"):
                print(f"{name:7} {n:6} failed: {r['error']}", flush=True)
            else:
                print(f"{name:7} {n:6} {r['bytes'] / 2**20:7.0f} {str(r['bit_exact']):>5} "
                      f"{r['plain_d2h_gbs']:7.2f} {r['save_gbs']:7.2f} "
                      f"{100 * r['save_vs_plain']:4.0f} {r['plain_h2d_gbs']:7.2f} "
                      f"{r['load_gbs']:7.2f} {100 * r['load_vs_plain']:4.0f}", flush=True)
            write()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{'tokens':>6} {'matmul ms':>9} {'saves ms':>9} {'both ms':>9} {'slowdown':>8} "
          f"{'overlap':>7}")
    for n in tokens:
        o = attempt(partial(bench_overlap, shape, n, copier, device, args.reps,
                            matmul_n=256 if args.small else 8192,
                            per_layer=2 if args.small else 4), {"tokens": n})
        overlap.append(o)
        if o.get("error"):
            print(f"{n:6} failed: {o['error']}", flush=True)
        else:
            print(f"{n:6} {1e3 * o['matmul_s']:9.2f} {1e3 * o['saves_s']:9.2f} "
                  f"{1e3 * o['matmul_with_saves_s']:9.2f} {o['forward_slowdown']:8.3f} "
                  f"{o['overlap_fraction']:7.2f}", flush=True)
        write()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok, meets = write()
    print(f"\nbit-exact: {ok}; save and load >= 80 % of the plain copy: {meets}")
    print(f"wrote {args.out}")
    if not ok:
        raise SystemExit("round trip not bit-exact (or a measurement failed)")


if __name__ == "__main__":
    main()
