"""`splitserve plan`: colocated or disaggregated, at which P:D, and over which KV connector.

    splitserve plan --profile P.json --workers 8 --request-rate 4 --slo-ttft-ms 1000 \\
        --slo-tpot-ms 50 [--connector splitserve|nixl|compare] [workload] --out-dir plan/
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from splitserve.bench.cli import add_workload_arguments, spec_from_args
from splitserve.bench.metrics import SLO
from splitserve.common.refusal import refusing
from splitserve.sim.cli_args import (
    add_connector_args,
    add_profile_arg,
    cli_profile,
    transport_for,
)


@refusing("plan")  # computation on its inputs alone: all of it refuses them
def run_plan(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from splitserve.sim.planner import (
        PlanRequest,
        candidate_configs,
        check_plannable,
        plan,
        plot_plan,
        print_plan,
    )

    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms are required")
    if args.gpus is not None:
        from splitserve.sim.gpuplan_cli import run_gpu_plan

        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn()) as bar:
            def progress(name: str, total: int) -> Callable[[], None]:
                task = bar.add_task(name, total=total)
                return lambda: bar.advance(task)

            run_gpu_plan(args, progress)
        return 0
    if args.workers is None:
        raise ValueError("give --workers N (a measured profile's workers) or --gpus N (TP "
                         "per pool, analytic or measured profiles)")
    prof, spec = cli_profile(args), spec_from_args(args)
    check_plannable(spec)
    connector = "splitserve" if args.connector == "compare" else args.connector
    req = PlanRequest(rate=spec.arrival.rate, slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
                      workers=args.workers, target=args.target,
                      transport=transport_for(args, prof, connector), connector=connector,
                      overlap=not args.no_overlap, pull_request_s=args.pull_request_ms / 1000,
                      chunk_budget=args.token_budget)
    out = Path(args.out_dir)
    if args.connector == "compare":
        from splitserve.sim.connectors import compare, print_comparison

        links = {c: transport_for(args, prof, c) for c in ("splitserve", "nixl")}
        missing = [t for t in links.values() if t not in prof.transfer]
        if missing:
            raise ValueError(f"the profile has no {missing} link (has {sorted(prof.transfer)}); "
                             "measure one: splitserve profile --add-links PROFILE --nixl-probe")
        if prof.split is not None:
            print("note: comparing connectors without the profile's split costs (they are "
                  "measured through splitserve's connector only)")
        c = compare(prof, spec, req, links)
        print_comparison(c)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(c.to_dict(), indent=2))
        pngs = [plot_plan(cp.plan, out / f"plan-{cp.connector}.png") for cp in c.plans]
        print(f"wrote {out / 'compare.json'} and {', '.join(map(str, pngs))}")
        return 0
    if connector != "splitserve" and prof.split is not None:
        print(f"note: the profile's split costs are splitserve's connector's; the {connector} "
              "candidates run without them")
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("plan: candidates simulated", total=len(candidate_configs(req)))
        p = plan(prof, spec, req, progress=lambda: bar.advance(task))
    print_plan(p)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(p.to_dict(), indent=2))
    png = plot_plan(p, out / "plan.png")
    print(f"wrote {out / 'plan.json'} and {png}")
    return 0


def register_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pl = sub.add_parser("plan", help="colocated or disaggregated, the best P:D, the connector")
    add_profile_arg(pl, "profile JSON (splitserve profile); required with --workers; with "
                    "--gpus, in place of --model-config (a measured one plans TP 1)")
    add_workload_arguments(pl)
    pl.add_argument("--workers", type=int, help="worker budget (P:D over one profile)")
    g = pl.add_argument_group("GPU planning (--gpus): TP per pool, counts, routing policy")
    g.add_argument("--gpus", type=int, help="GPU budget: search TP per pool, P and D counts "
                   "and the routing policy, and where disaggregation pays (a ladder of budgets)")
    g.add_argument("--model-config", help="HF config.json, its directory, or a Hugging Face "
                   "model id (analytic profiles, one a TP degree)")
    g.add_argument("--hardware", default="h100-sxm",
                   choices=("a100-80g", "h100-sxm", "h200", "l40s"))
    g.add_argument("--dtype-bytes", type=int, default=2,
                   help="bytes a weight and KV value in the analytic profiles (default 2; the "
                   "deploy command serves --dtype bfloat16 for 2, float32 for 4)")
    g.add_argument("--tp", help="TP degrees to search, e.g. 2,4,8 (default 1,2,4,8: those "
                   "the model fits)")
    g.add_argument("--policies", help="routing policies to search, e.g. cache,load (default: "
                   "both on workloads with repeated prefixes, else cache)")
    g.add_argument("--no-ladder", action="store_true", help="plan the budget only")
    g.add_argument("--cache-block-tokens", type=int, default=None,
                   help="prefix-cache block for token-id prompts (default: 16 analytic, 128 "
                   "measured)")
    pl.add_argument("--target", type=float, default=0.9, help="attainment target")
    pl.add_argument("--token-budget", type=int, default=None, help="chunked baseline budget")
    add_connector_args(pl, compare=True)
    pl.add_argument("--no-overlap", action="store_true")
    pl.add_argument("--out-dir", default="plan")
    pl.set_defaults(func=run_plan, num_prompts=1000)  # attainment needs more than 100
