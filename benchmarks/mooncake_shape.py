"""The shape of the Mooncake paper's (FAST'25) prefix-cache results, from its public traces,
through splitserve's simulator: Llama-3.1-8B on H100-SXM GPUs (the analytic roofline profile),
P/D disaggregated, splitserve's connector over the profile's link.

1. Cache ratio with an unbounded cache (the paper's Table 2): one global cache over the whole
   stream; a request's hit is its leading run of hash blocks an earlier request had, in tokens,
   capped at its prompt (`ratio`, token-weighted; `request_mean`: the mean of each request's
   share), and what an engine reuses of it (`engine`: `routing.prefix.reusable`, the last
   prompt token is always computed). Then one LRU cache of 10^4..10^8 tokens over the whole
   stream (the paper's Figure 9 axis).
2. Hit rate against per-worker cache capacity (the paper's Figure 9) through the simulator: a
   cache-blind router (`load`, `cache_aware=False`) and a cache-aware one (`cache`) on the same
   P/D cluster as 3., every prompt prefilled on P, each worker's KV capacity swept from the
   smallest that runs the stream (every request's prompt + output must fit one worker's KV, or
   it fails) to unbounded; next to them one LRU cache of all P-workers' capacity together (no
   pinning, no running requests' KV: the pooled ideal).
3. Routing on a loaded cluster (the paper's Figure 5): `random`, `load` (both cache-blind) and
   `cache` (cache-aware) for P and D, at the profile's own KV capacity; TTFT p50/p90, hit rate,
   prefill engine-seconds. The trace is replayed `--time-scale` times faster and the cluster is
   N P + N D workers, N sized so that the stream's prefill work without any hit fills the P
   pool to `--utilisation` (prompts chunked at the token budget, `PrefillCost`).

Prints the tables and writes JSON (default benchmarks/results/mooncake_shape.json). The traces
are the user's files (public data, never committed here):

    python benchmarks/mooncake_shape.py --conversation conversation_trace.jsonl \
        [--synthetic synthetic_trace.jsonl] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from splitserve.bench.repeat import TRACE_BLOCK_TOKENS, MooncakeOptions
from splitserve.bench.workload import WorkloadSpec
from splitserve.routing.prefix import reusable
from splitserve.sim.analytic import PRESETS, ModelConfig, analytic_profile
from splitserve.sim.deployment import Policy, SimConfig
from splitserve.sim.model import Profile
from splitserve.sim.results import summarize
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload, arrays_from_spec

# Llama-3.1-8B's public config (what the paper's traces are replayed on here)
LLAMA_8B = ModelConfig(name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8,
                       head_dim=128, intermediate=14336, vocab=128256)
PAPER_CACHE_RATIO = {"conversation": 0.40, "toolagent": 0.59, "synthetic": 0.66}  # Table 2
ARMS: tuple[tuple[Policy, bool], ...] = (("random", False), ("load", False), ("cache", True))
TOP_CAPACITY = 2 ** 25  # the largest finite per-worker capacity swept (tokens)
GLOBAL_CAPACITIES = (10**4, 10**5, 10**6, 3 * 10**6, 10**7, 3 * 10**7, 10**8)  # Figure 9's axis


def load_trace(path: str | Path, time_scale: float = 1.0, max_requests: int | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> SimWorkload:
    """The trace's replay as `splitserve sim --workload mooncake` reads it (every row, sorted
    by time, lengths as in the trace, arrivals `time_scale` times faster), with its hash ids as
    prefix keys of `block_tokens`-token blocks."""
    opts = MooncakeOptions(block_tokens=block_tokens, time_scale=time_scale,
                           max_requests=max_requests)
    return arrays_from_spec(WorkloadSpec(source="mooncake", path=str(path), warmup=0,
                                         mooncake=opts))


def _blocks(wl: SimWorkload) -> tuple[tuple[int, ...], ...]:
    if wl.blocks is None:
        raise ValueError("the workload has no prefix identity (not a Mooncake replay)")
    return wl.blocks


def leading(keys: Sequence[int], held: Container[int]) -> int:
    """How many of `keys`, from the first, `held` holds (a prefix hit, in blocks)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


def unbounded_ratio(wl: SimWorkload) -> dict[str, float | int]:
    """Table 2's cache ratio of `wl` in arrival order, one unbounded global cache (every key a
    request brings is kept): `ratio` = Σ hit / Σ prompt, hit = min(leading keys seen before ×
    block, prompt); `engine` the same with each hit as the engine reuses it (`reusable`);
    `request_mean` = the mean over requests of hit / prompt; `any_position` counts every block
    seen before, leading or not (its tokens; equal to `ratio` when keys name whole prefixes,
    as the Mooncake traces' hash ids do)."""
    b, seen = wl.block_tokens, set[int]()
    hit = engine = anywhere = 0
    shares = 0.0
    for keys, n in zip(_blocks(wl), wl.prompt_lens.tolist(), strict=True):
        h = min(leading(keys, seen) * b, n)
        hit, engine, shares = hit + h, engine + reusable(h, n, b), shares + h / n
        anywhere += sum(min(b, n - i * b) for i, key in enumerate(keys) if key in seen)
        seen.update(keys)
    total = int(wl.prompt_lens.sum())
    return {"prompt_tokens": total, "hit_tokens": hit, "ratio": hit / total,
            "engine": engine / total, "request_mean": shares / len(wl),
            "any_position": anywhere / total}


def lru_hit_rate(wl: SimWorkload, capacity_tokens: int) -> float:
    """The engine-reusable hit rate of one LRU cache of `capacity_tokens` over `wl` in arrival
    order: a request's hit is its leading keys held (`reusable`), then its full blocks become
    the most recent and the least recent are evicted past capacity // block. No pinning and no
    running requests' KV (the bound a pooled cache of that size reaches); with a capacity that
    holds every block it equals `unbounded_ratio(wl)["engine"]`."""
    b = wl.block_tokens
    room = capacity_tokens // b
    lru: OrderedDict[int, None] = OrderedDict()
    reused = 0
    for keys, n in zip(_blocks(wl), wl.prompt_lens.tolist(), strict=True):
        reused += reusable(min(leading(keys, lru) * b, n), n, b)
        for key in keys[:n // b]:
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > room:
            lru.popitem(last=False)
    return reused / int(wl.prompt_lens.sum())


def profile_for(hardware: str = "h100-sxm") -> Profile:
    """Llama-3.1-8B's analytic profile on one GPU of `hardware` (an `analytic.PRESETS` key)."""
    return analytic_profile(LLAMA_8B, PRESETS[hardware])


def min_capacity(wl: SimWorkload) -> int:
    """The smallest per-worker KV capacity (tokens, whole blocks) that runs every request:
    a D reserves a request's prompt + output at admission, and one that can never fit fails."""
    need = int((wl.prompt_lens + wl.output_lens).max())
    return -(-need // wl.block_tokens) * wl.block_tokens


def capacities(wl: SimWorkload, profile: Profile, steps: int | None = None) -> list[int]:
    """The per-worker capacities swept: `min_capacity`, the profile's own, and the powers of
    two above the first up to `TOP_CAPACITY` (at most `steps` of them, spread out), then one
    that never evicts (the whole stream's KV), always last."""
    low = min_capacity(wl)
    powers = [2 ** e for e in range(math.floor(math.log2(low)) + 1, 26)]
    if steps is not None and len(powers) > steps:
        powers = [powers[round(i * (len(powers) - 1) / (steps - 1))] for i in range(steps)]
    never = int((wl.prompt_lens + wl.output_lens).sum())
    finite = {c for c in [low, *powers] if c < never}
    if low <= profile.kv_capacity_tokens < never:
        finite.add(profile.kv_capacity_tokens)
    return sorted(finite) + [max(never, TOP_CAPACITY + 1)]


@dataclass(frozen=True)
class Cluster:
    """N P + N D workers; the trace replayed `time_scale` times faster (already in the
    workload); `utilisation`: the P pool's share busy prefilling the stream with no hit."""

    n: int
    time_scale: float
    utilisation: float


def size_cluster(wl: SimWorkload, profile: Profile, time_scale: float, target: float
                 ) -> Cluster:
    """The fewest P-workers whose pool the stream's prefill work (no hits; each prompt in
    token-budget chunks: a·chunks + b·n + c·n²) keeps at most `target` busy over its span."""
    pf, budget = profile.prefill, profile.token_budget
    work = sum(pf.a * -(-n // budget) + pf.b * n + pf.c * n * n
               for n in wl.prompt_lens.tolist())
    span = float(wl.arrivals[-1] - wl.arrivals[0]) or 1.0
    n = max(1, math.ceil(work / (target * span)))
    return Cluster(n, time_scale, work / (n * span))


def run_arm(profile: Profile, wl: SimWorkload, cluster: Cluster, policy: Policy, aware: bool,
            capacity: int | None = None, prefill_on_d: bool = True) -> dict[str, Any]:
    """One simulated run: `policy` for P and D, the router's cache index on or off, every
    worker's KV capacity `capacity` (None: the profile's), prefill on D by the router's rule or
    never. The result's cache and TTFT keys."""
    prof = profile if capacity is None else replace(profile, kv_capacity_tokens=capacity)
    cfg = SimConfig("disagg", n_prefill=cluster.n, n_decode=cluster.n, p_policy=policy,
                    d_policy=policy, transport=next(iter(prof.transfer)), cache_aware=aware)
    if not prefill_on_d:
        cfg = replace(cfg, local_prefill_max_tokens=0)
    res = summarize(simulate(prof, cfg, wl))
    span = float(wl.arrivals[-1] - wl.arrivals[0]) or 1.0
    return {"policy": policy, "cache_aware": aware, "capacity": prof.kv_capacity_tokens,
            "hit_rate": res["prefix_hit_rate"], "ttft_p50_ms": res["median_ttft_ms"],
            "ttft_p90_ms": res["p90_ttft_ms"], "tpot_p50_ms": res["median_tpot_ms"],
            "prefill_engine_s": res["prefill_engine_s"],
            "p_busy": res["prefill_engine_s"] / (cluster.n * span),
            "local_prefills": res["local_prefills"], "kv_bytes_moved": res["kv_bytes_moved"],
            "completed": res["completed"], "failed": res["failed"]}


def capacity_sweep(profile: Profile, wl: SimWorkload, cluster: Cluster, caps: list[int]
                   ) -> list[dict[str, Any]]:
    """Per capacity: the blind (`load`) and aware (`cache`) hit rates in the simulator, every
    prompt prefilled on P (no prefill on D: the hits are the P pool's caches alone), and one LRU
    of the P pool's capacity together (`lru_hit_rate`).

    Prefill on D is off here because with it the aware hit rate need not grow with capacity: D's
    pick weighs its KV fraction, so the capacity changes which requests run whole on a D, and
    such a request's blocks stay on that D, out of the P pool's caches."""
    rows = []
    for cap in caps:
        blind = run_arm(profile, wl, cluster, "load", False, cap, prefill_on_d=False)
        aware = run_arm(profile, wl, cluster, "cache", True, cap, prefill_on_d=False)
        rows.append({"capacity": cap, "blind": blind["hit_rate"], "aware": aware["hit_rate"],
                     "pooled_lru": lru_hit_rate(wl, cap * cluster.n),
                     "failed": blind["failed"] + aware["failed"]})
    return rows


def shape_of(name: str, path: str, profile: Profile, args: argparse.Namespace
             ) -> dict[str, Any]:
    """Everything for one trace: unbounded ratio, the capacity sweep, the routing arms."""
    t0 = time.perf_counter()
    wl = load_trace(path, args.time_scale, args.max_requests)
    cluster = size_cluster(wl, profile, args.time_scale, args.utilisation)
    caps = capacities(wl, profile, args.capacity_steps)
    out = {"trace": name, "requests": len(wl), "paper_cache_ratio": PAPER_CACHE_RATIO.get(name),
           "unbounded": unbounded_ratio(wl),
           "global_lru": {str(c): lru_hit_rate(wl, c) for c in GLOBAL_CAPACITIES},
           "min_capacity": min_capacity(wl),
           "cluster": asdict(cluster),
           "sweep": capacity_sweep(profile, wl, cluster, caps),
           "routing": [run_arm(profile, wl, cluster, p, a) for p, a in ARMS]}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def _tokens(c: int) -> str:
    return f"{c / 1e6:.3g} M" if c >= 1e6 else f"{c / 1e3:.0f} k"


def print_tables(results: list[dict[str, Any]], profile: Profile) -> None:
    """The three tables, as markdown."""
    print("\n1. cache ratio, one unbounded cache (prefix order)\n")
    print("| trace | requests | ratio (tokens) | any position | mean per request | "
          "engine-reusable | paper |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        u = r["unbounded"]
        print(f"| {r['trace']} | {r['requests']} | {_pct(u['ratio'])} | "
              f"{_pct(u['any_position'])} | {_pct(u['request_mean'])} | {_pct(u['engine'])} | "
              f"{_pct(r['paper_cache_ratio'])} |")
    print("\none LRU cache over the whole stream (engine-reusable hit rate) by capacity\n")
    print("| trace | " + " | ".join(_tokens(c) for c in GLOBAL_CAPACITIES) + " |")
    print("|---|" + "---|" * len(GLOBAL_CAPACITIES))
    for r in results:
        print(f"| {r['trace']} | " + " | ".join(_pct(v) for v in r["global_lru"].values()) + " |")
    for r in results:
        c = r["cluster"]
        print(f"\n2. {r['trace']}: hit rate against per-worker KV capacity, {c['n']}P+{c['n']}D, "
              f"all prefills on P "
              f"(smallest capacity that runs it: {_tokens(r['min_capacity'])} tokens)\n")
        print("| capacity / worker | blind (load) | aware (cache) | one LRU of the P pool's |")
        print("|---|---|---|---|")
        for s in r["sweep"]:
            cap = _tokens(s["capacity"]) + (" (profile)" if s["capacity"] ==
                                            profile.kv_capacity_tokens else "")
            if s is r["sweep"][-1]:
                cap = "unbounded"
            print(f"| {cap} | {_pct(s['blind'])} | {_pct(s['aware'])} | "
                  f"{_pct(s['pooled_lru'])} |" + (f" {s['failed']} failed" if s["failed"] else ""))
    for r in results:
        c = r["cluster"]
        print(f"\n3. {r['trace']}: routing, {c['n']}P+{c['n']}D, time scale {c['time_scale']:g}, "
              f"P pool {100 * c['utilisation']:.0f} % busy without hits, "
              f"{_tokens(profile.kv_capacity_tokens)} tokens KV per worker\n")
        print("| policy | TTFT p50 ms | TTFT p90 ms | hit rate | prefill engine-s | P busy | "
              "TPOT p50 ms | prefills on D |")
        print("|---|---|---|---|---|---|---|---|")
        for a in r["routing"]:
            print(f"| {a['policy']}{'' if a['cache_aware'] else ' (blind)'} | "
                  f"{a['ttft_p50_ms']:.0f} | {a['ttft_p90_ms']:.0f} | {_pct(a['hit_rate'])} | "
                  f"{a['prefill_engine_s']:.0f} | {_pct(a['p_busy'])} | "
                  f"{a['tpot_p50_ms']:.1f} | {a['local_prefills']} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversation", required=True, help="conversation_trace.jsonl")
    p.add_argument("--synthetic", help="synthetic_trace.jsonl (optional)")
    p.add_argument("--hardware", choices=sorted(PRESETS), default="h100-sxm")
    p.add_argument("--time-scale", type=float, default=8.0,
                   help="replay the traces this many times faster (routing and TTFT)")
    p.add_argument("--utilisation", type=float, default=0.85,
                   help="size the P pool so the stream's prefill work without hits fills this "
                        "share of it")
    p.add_argument("--quick", action="store_true",
                   help="the first 2,000 requests of each trace, 6 capacities at most")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/mooncake_shape.json"))
    args = p.parse_args(argv)
    if not 0 < args.utilisation <= 1:
        p.error("--utilisation must be in (0, 1]")
    args.max_requests, args.capacity_steps = (2000, 3) if args.quick else (None, None)
    profile = profile_for(args.hardware)
    t0 = time.perf_counter()
    traces = [("conversation", args.conversation)]
    if args.synthetic:
        traces.append(("synthetic", args.synthetic))
    results = []
    for name, path in traces:
        results.append(shape_of(name, path, profile, args))
        print(f"{name}: {results[-1]['wall_s']} s", flush=True)
    print_tables(results, profile)
    wall = round(time.perf_counter() - t0, 1)
    print(f"\n{LLAMA_8B.name} on {profile.hardware['name']} (analytic), "
          f"{'quick' if args.quick else 'full'} run: {wall} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"model": LLAMA_8B.name, "hardware": profile.hardware["name"],
         "kv_capacity_tokens": profile.kv_capacity_tokens, "quick": args.quick,
         "time_scale": args.time_scale, "utilisation": args.utilisation, "wall_s": wall,
         "traces": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
