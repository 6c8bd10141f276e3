"""`splitserve plan --gpus N`: the GPU planner (`sim.gpuplan`) as a command.

    splitserve plan --gpus 16 --model-config CONFIG --hardware h100-sxm \\
        --slo-ttft-ms 2000 --slo-tpot-ms 80 --workload mooncake --dataset-path trace.jsonl

Profiles: analytic, one per TP degree (`--tp`, default 1, 2, 4, 8: those the model fits), from
`--model-config` and `--hardware`; or `--profile` (a measured one: TP 1 only). It prints the
candidates (best first), the ladder of budgets with one sentence on where disaggregation pays,
the plan's choice and the commands that deploy it; it writes `gpuplan.json` and `gpuplan.png`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from splitserve.bench.metrics import SLO
from splitserve.bench.workload import WorkloadSpec
from splitserve.sim.deployment import POLICIES, Policy
from splitserve.sim.gpuplan import GpuPlan, GpuPlanner, GpuPlanRequest, Rung, Shape
from splitserve.sim.model import Profile

TPS = (1, 2, 4, 8)
SERVE_DTYPES = {2: "bfloat16", 4: "float32"}  # bytes a value → splitserve serve --dtype
# the plan's options that `--gpus` does not take: (dest, its default, the flag)
NOT_WITH_GPUS = (
    ("connector", "splitserve", "--connector"), ("transport", None, "--transport"),
    ("no_overlap", False, "--no-overlap"), ("pull_request_ms", 0.0, "--pull-request-ms"),
    ("token_budget", None, "--token-budget"))


def check_gpu_options(args: argparse.Namespace) -> None:
    """ValueError when `args` gives an option `--gpus` does not take (`NOT_WITH_GPUS`, at other
    than its default): its candidates run splitserve's connector, overlapped, over the
    profiles' rdma link (else tcp) at each profile's token budget."""
    given = [flag for dest, default, flag in NOT_WITH_GPUS if getattr(args, dest) != default]
    if given:
        raise ValueError(f"--gpus plans splitserve's connector over the profiles' rdma (else "
                         f"tcp) link at their own token budgets; it takes no {', '.join(given)}")


def plan_profiles(args: argparse.Namespace) -> dict[int, Profile]:
    """One profile a TP degree the model fits (`--tp`), analytic or `--profile`'s (TP 1).
    ValueError for `--tp` with a measured profile, neither `--model-config` nor `--profile`,
    or a model no TP degree of `--tp` fits."""
    from splitserve.sim.analytic import PRESETS, ModelConfig, analytic_profile
    from splitserve.sim.cli_args import cli_profile, model_path

    tps = tuple(int(x) for x in args.tp.split(",")) if args.tp else TPS
    if args.profile:
        if tps != (1,) and args.tp:
            raise ValueError("a measured --profile is one TP-1 worker; --tp needs an analytic "
                             "profile (--model-config and --hardware)")
        return {1: cli_profile(args)}
    if not args.model_config:
        raise ValueError("--gpus needs --model-config (and --hardware) or "
                         "--profile")
    model = ModelConfig.from_hf(model_path(args.model_config) or "", args.dtype_bytes)
    out: dict[int, Profile] = {}
    for tp in tps:
        try:
            out[tp] = analytic_profile(model, PRESETS[args.hardware], tp=tp)
        except ValueError as exc:
            print(f"note: tp={tp} left out: {exc}")
    if not out:
        raise ValueError(f"{model.name} fits no TP degree of {tps} on {args.hardware}")
    return out


def serve_dtype(profiles: dict[int, Profile]) -> str | None:
    """The `splitserve serve --dtype` the plan sized its workers at: `bfloat16` or `float32`
    when every profile is analytic at 2 or 4 bytes a value (`--dtype-bytes`); None for a
    measured profile (its worker's dtype is not recorded) or another width (serve has no such
    dtype)."""
    if any(p.kind != "analytic" for p in profiles.values()):
        return None
    widths = {p.model.dtype_bytes for p in profiles.values()}
    return SERVE_DTYPES.get(widths.pop()) if len(widths) == 1 else None


def deploy_commands(shape: Shape, model_flag: str, dtype: str | None = None) -> list[str]:
    """The command that starts `shape` with splitserve's launcher (`model_flag`: `--model NAME`
    or `--embedded`; `dtype`: its `--dtype`, none when None), each pool at its TP degree, on
    the plan's KV connector."""
    c = shape.config
    if dtype is not None:
        model_flag = f"{model_flag} --dtype {dtype}"
    tp = lambda pool, t: f" --{pool}-tp {t}" if t > 1 else ""  # noqa: E731
    if c.mode != "disagg":
        return [f"splitserve serve {model_flag} --colocated {c.n_workers}"
                f"{tp('colocated', shape.tp_p)}"]
    policies = f"--prefill-policy {c.p_policy} --decode-policy {c.d_policy}"
    connector = "" if c.connector == "splitserve" else f" --connector {c.connector}"
    return [f"splitserve serve {model_flag} --prefill {c.n_prefill} --decode {c.n_decode} "
            f"{policies}{tp('prefill', shape.tp_p)}{tp('decode', shape.tp_d)}{connector}"]


def print_gpu_plan(plan: GpuPlan, rungs: list[Rung], verdict: str | None, model_flag: str,
                   dtype: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    req = plan.request
    t = Table(title=f"{req.gpus} GPUs at {req.rate:.3g} req/s (TTFT ≤ {req.slo.ttft_ms:g} ms, "
                    f"TPOT ≤ {req.slo.tpot_ms:g} ms; simulated)")
    for col in ("deployment", "GPUs", "attainment", "goodput req/s", "per GPU", "TTFT p50 ms",
                "TTFT p90 ms", "TPOT p50 ms", "hit rate"):
        t.add_column(col, justify="right")

    def f(v: Any, spec: str = ".3g") -> str:
        return "-" if v is None else format(v, spec)

    ranked = sorted(plan.candidates, key=lambda c: (-(c.goodput_per_gpu or 0), -c.attainment))
    for c in ranked[:12]:
        m = c.metrics or {}
        t.add_row(c.shape.label + (" *" if c is plan.best else ""), str(c.shape.gpus),
                  f"{c.attainment:.1%}", (f(c.goodput) + ("+" if c.goodput_bound == "lower"
                                                          else "")) if c.searched
                  else "(not searched)",
                  f(c.goodput_per_gpu), f(m.get("median_ttft_ms"), ".0f"),
                  f(m.get("p90_ttft_ms"), ".0f"), f(m.get("median_tpot_ms"), ".1f"),
                  f(m.get("prefix_hit_rate"), ".2f"))
    console = Console(width=max(Console().width, 120))
    console.print(t)
    if rungs:
        lt = Table(title="where disaggregation pays: best goodput per GPU at each budget")
        for col in ("GPUs", "best colocated", "per GPU", "best disaggregated", "per GPU"):
            lt.add_column(col, justify="right")
        for r in rungs:
            lt.add_row(str(r.gpus), r.colocated.shape.label if r.colocated else "-",
                       f(r.colocated.goodput_per_gpu if r.colocated else None),
                       r.disagg.shape.label if r.disagg else "-",
                       f(r.disagg.goodput_per_gpu if r.disagg else None))
        console.print(lt)
    console.print(f"[bold]plan:[/bold] {plan.verdict}")
    if any(c.goodput_bound == "lower" for c in plan.candidates):
        console.print("(+ = goodput is a lower bound: the stream met the SLOs at every rate "
                      "tried; give it more requests to find the limit)")
    if verdict:
        console.print(f"[bold]advice:[/bold] {verdict}")
    console.print("[bold]deploy:[/bold]\n  " + "\n  ".join(deploy_commands(plan.best.shape,
                                                                         model_flag, dtype)))


def plot_gpu_plan(plan: GpuPlan, rungs: list[Rung], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if rungs:
        xs = [r.gpus for r in rungs]
        for name, pick in (("colocated", lambda r: r.colocated),
                           ("disaggregated", lambda r: r.disagg)):
            ys = [(pick(r).goodput_per_gpu or 0.0) if pick(r) else 0.0 for r in rungs]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
    else:
        cands = sorted(plan.candidates, key=lambda c: -(c.goodput_per_gpu or 0))[:10]
        ax.bar([c.shape.label for c in cands], [c.goodput_per_gpu or 0 for c in cands])
        plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title(f"best deployment per budget (simulated, target {plan.request.target:.0%})")
    ax.legend() if rungs else None
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def given_policies(args: argparse.Namespace) -> tuple[str, ...] | None:
    """`--policies` as given (None: not given); ValueError for an entry the simulator does
    not know."""
    if not args.policies:
        return None
    policies = tuple(args.policies.split(","))
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        raise ValueError(f"unknown --policies {unknown}; known: {', '.join(POLICIES)}")
    return policies


def plan_and_ladder(profiles: dict[int, Profile], spec: WorkloadSpec, args: argparse.Namespace,
                    progress: Callable[[str, int], Callable[[], None]]
                    ) -> tuple[GpuPlan, list[Rung], str | None]:
    """Plan `args.gpus` over `profiles` on `spec`'s stream (`--policies`, `--target`, SLOs,
    `--cache-block-tokens`), then the ladder unless `--no-ladder`: (plan, rungs, verdict).
    ValueError for a `--policies` entry the simulator does not know."""
    from splitserve.sim.cli_args import cache_block_tokens
    from splitserve.sim.gpuplan import budgets, ladder, ladder_verdict, shapes
    from splitserve.sim.workload import arrays_from_spec

    wl = arrays_from_spec(spec, cache_block_tokens(args, next(iter(profiles.values()))))
    rate = spec.arrival.rate if spec.source == "synthetic" else wl.offered_rate
    policies = given_policies(args) or (
        ("cache", "load") if wl.blocks is not None else ("cache",))
    links = next(iter(profiles.values())).transfer
    transport = next((t for t in ("rdma", "tcp") if t in links), min(links, default="tcp"))
    req = GpuPlanRequest(args.gpus, rate, SLO(args.slo_ttft_ms, args.slo_tpot_ms),
                         cast(tuple[Policy, ...], policies), args.target, transport)
    planner = GpuPlanner(profiles, wl)
    planner.progress = progress("plan: candidates simulated", planner.count(req))
    plan = planner.plan(req)
    rungs: list[Rung] = []
    if not args.no_ladder:
        total = sum(len(shapes(b, tuple(profiles), req.policies, req.transport))
                    for b in budgets(args.gpus)[:-1])
        planner.progress = progress("ladder: candidates simulated", total)
        rungs = ladder(planner, req, plan)
    return plan, rungs, ladder_verdict(rungs) if rungs else None


def plan_json(plan: GpuPlan, rungs: list[Rung], verdict: str | None, model_flag: str,
              dtype: str | None = None) -> dict[str, Any]:
    """The plan, the ladder, the advice and the deploy commands, as written to JSON."""
    return plan.to_dict() | {
        "advice": verdict, "deploy": deploy_commands(plan.best.shape, model_flag, dtype),
        "ladder": [{"gpus": r.gpus, "winner": r.winner,
                    "colocated": r.colocated.to_dict() if r.colocated else None,
                    "disagg": r.disagg.to_dict() if r.disagg else None} for r in rungs]}


def run_gpu_plan(args: argparse.Namespace, progress: Callable[[str, int], Callable[[], None]]
                 ) -> dict[str, Any]:
    """The whole command: plan, ladder, print, write; returns the JSON it wrote. ValueError
    for an option `--gpus` does not take (`check_gpu_options`) or a workload the simulator
    does not replay (`check_open_loop`), before any profile is made."""
    from splitserve.bench.cli import spec_from_args
    from splitserve.sim.workload import check_open_loop

    check_gpu_options(args)
    spec = spec_from_args(args)
    check_open_loop(spec)
    profiles = plan_profiles(args)
    plan, rungs, verdict = plan_and_ladder(profiles, spec, args, progress)
    model_flag = f"--model {args.model_config}" if args.model_config else "--model MODEL"
    dtype = serve_dtype(profiles)
    print_gpu_plan(plan, rungs, verdict, model_flag, dtype)
    out = Path(args.out_dir)
    doc = plan_json(plan, rungs, verdict, model_flag, dtype)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpuplan.json").write_text(json.dumps(doc, indent=2))
    png = plot_gpu_plan(plan, rungs, out / "gpuplan.png")
    print(f"wrote {out / 'gpuplan.json'} and {png}")
    return doc
