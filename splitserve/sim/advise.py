"""`splitserve advise`: one command from "my model, my hardware, my traffic" to a plan, verified
where the hardware is at hand.

    splitserve advise --model org/name --hardware h100-sxm --gpus 16 --slo-ttft-ms 2000 \\
        --slo-tpot-ms 80 --workload mooncake --dataset-path trace.jsonl
    splitserve advise --embedded --hardware cpu --gpus 2 --slo-ttft-ms 1500 --slo-tpot-ms 150

1. Profiles. `--hardware cpu` (this machine): measured, a plain worker of the model on one core
   profiled on a small grid (`sim.profile`; `--profile P.json` reuses one instead); a GPU preset:
   analytic, one profile a TP degree the model fits (`sim.analytic`), from its config.json.
2. Plan: every candidate of the budget (`--gpus`: GPUs, or cores on `cpu`) is simulated, the
   shortlist's goodput searched, and a ladder of budgets says where disaggregation pays
   (`sim.gpuplan`).
3. Verify (`cpu` only; `--no-verify` skips it): the chosen deployment is started here by
   splitserve's launcher on `--deploy-cores`, measured by `bench compare` beside a plain vLLM
   worker started on the same cores (the benchmark's `colocated` arm), both on the same stream,
   and the simulated figures of the choice are printed against its measured ones.

Output: the plan's table, the ladder, one sentence of advice, the commands that deploy the
choice, the verification table; `advise.json` and `gpuplan.png` in `--out-dir`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from splitserve.bench.cli import add_workload_arguments, spec_from_args
from splitserve.common.refusal import refusing
from splitserve.sim.gpuplan import GpuPlan, Shape
from splitserve.sim.model import Profile

HARDWARE = ("cpu", "a100-80g", "h100-sxm", "h200", "l40s")
COMPARED = (("median_ttft_ms", "TTFT p50 ms"), ("p90_ttft_ms", "TTFT p90 ms"),
            ("median_tpot_ms", "TPOT p50 ms"), ("prefix_hit_rate", "prefix hit rate"),
            ("request_throughput", "req/s"))


def model_source(args: argparse.Namespace) -> tuple[str, str]:
    """(the model's directory, its flag for the deploy commands): `--model`, else embedded."""
    if args.model:
        from splitserve.sim.cli_args import model_path

        return model_path(args.model) or args.model, f"--model {args.model}"
    from splitserve.demo_model import embedded_model_dir

    return str(embedded_model_dir()), "--embedded"


def measured_profile(model_dir: str, core: int, quick_grid: bool = True) -> Profile:
    """A plain worker of `model_dir` on `core`, profiled (no prefix caching) and stopped."""
    from splitserve.sim.model import VLLM_CPU_TOKEN_BUDGET
    from splitserve.sim.profile import ProfilePlan, profile_worker
    from splitserve.sim.validate import local_worker

    plan = ProfilePlan()
    if quick_grid:
        plan = replace(plan, prefill_lens=(16, 256, 1024, 2048), prefill_repeats=2,
                       decode_batches=(1, 4, 8), decode_prompt_lens=(32, 1024))
    print(f"advise: profiling a plain worker of {model_dir} on core {core}")
    with local_worker(model_dir, (core,), VLLM_CPU_TOKEN_BUDGET) as url:
        return profile_worker(url, plan, model_dir, probe_tcp=True)


def given_profiles(args: argparse.Namespace, model_dir: str) -> dict[int, Profile] | None:
    """One profile a TP degree (see the module docstring, step 1), made from the inputs:
    analytic on a GPU preset, `--profile`'s on `cpu`; None when a worker of the model is to
    be profiled (`measured_profile`). ValueError as `gpuplan_cli.plan_profiles`."""
    from splitserve.sim.gpuplan_cli import plan_profiles

    if args.hardware != "cpu":
        return plan_profiles(argparse.Namespace(
            tp=args.tp, profile=None, model_config=model_dir, hardware=args.hardware,
            dtype_bytes=args.dtype_bytes))
    if args.profile:
        from splitserve.sim.cli_args import cli_profile

        return {1: cli_profile(args)}
    return None


@contextmanager
def started(shape: Shape, model: str | None, cores: tuple[int, ...], log_dir: Path
            ) -> Iterator[str]:
    """`shape` (TP-1 workers) started here by splitserve's launcher for the block: its router's
    URL. The engines keep their prefix caches and report cached tokens; the router runs the
    shape's policies (a colocated pool: the router's own, `load`)."""
    from splitserve.config import TRANSPORTS
    from splitserve.launch.config import DeploymentConfig
    from splitserve.launch.local import LocalDeployment
    from splitserve.worker.launch import free_port

    c = shape.config
    split = c.mode == "disagg"
    dep = DeploymentConfig(prefill=c.n_prefill if split else 0, decode=c.n_decode if split else 0,
                           colocated=0 if split else c.n_workers, model=model or "embedded",
                           transport=c.transport if c.transport in TRANSPORTS else "tcp",
                           port=free_port(), cpus=cores, log_dir=str(log_dir),
                           worker_args=("--enable-prompt-tokens-details",))
    if split:
        dep = replace(dep, prefill_policy=c.p_policy, decode_policy=c.d_policy,
                      local_prefill_max_tokens=c.local_prefill_max_tokens)
    with LocalDeployment(dep) as deployment:
        yield deployment.url


def verify(args: argparse.Namespace, plan: GpuPlan, out: Path) -> dict[str, Any]:
    """Run the choice and a plain colocated worker here on the same stream and cores; the
    choice's simulated figures against its measured ones."""
    from splitserve.bench.cli import run_compare
    from splitserve.common.refusal import Refused

    shape = plan.best.shape
    if shape.tp_p != 1 or shape.tp_d > 1:
        return {"verified": False, "why": f"{shape.label} needs TP > 1"}
    cores = tuple(args.deploy_cores)
    if len(cores) < min(shape.gpus, 2):
        return {"verified": False, "why": f"{shape.label} needs {shape.gpus} cores"}
    ns = argparse.Namespace(**vars(args))
    ns.revision = None
    ns.deploy, ns.deploy_cores, ns.deploy_model = ["colocated=colocated"], cores, args.model
    ns.speculative_config = None  # the plain colocated arm never drafts
    ns.out = str(out / "verify")
    with started(shape, args.model, cores, out / "logs") as url:
        ns.url, ns.deployment = [("advised", url)], [("advised", shape.label)]
        try:
            run_compare(ns)
        except Refused as exc:  # after the plan: reported as not verified, not as bad input
            return {"verified": False, "why": str(exc)}
    measured = json.loads((out / "verify" / "advised.json").read_text())
    baseline = json.loads((out / "verify" / "colocated.json").read_text())
    predicted = dict(plan.best.metrics or {})
    rows = [{"metric": key, "label": label, "predicted": predicted.get(key),
             "measured": measured.get(key), "colocated_measured": baseline.get(key)}
            for key, label in COMPARED]
    return {"verified": True, "cores": list(cores), "rows": rows}


def print_verification(v: dict[str, Any], label: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not v.get("verified"):
        console.print(f"[bold]verify:[/bold] not run ({v.get('why', 'skipped')})")
        return
    t = Table(title=f"{label}: simulated against measured here (cores {v['cores']})")
    for col in ("metric", "predicted", "measured", "error", "plain colocated, measured"):
        t.add_column(col, justify="right")

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3g}"

    for r in v["rows"]:
        p, m = r["predicted"], r["measured"]
        err = f"{(p - m) / m:+.0%}" if p is not None and m else "-"
        t.add_row(r["label"], f(p), f(m), err, f(r["colocated_measured"]))
    console.print(t)


def run_advise(args: argparse.Namespace) -> int:
    """The whole command (see the module docstring). Its inputs (the SLOs, `--gpus`, `--tp` on
    `cpu`, `--policies`, `--target`, the model, the workload, the profiles made from them) are
    refused in one line before any worker is profiled, and the plan's own (the workload's file)
    after; profiling and verifying keep their errors' tracebacks."""
    from splitserve.sim.gpuplan_cli import (
        given_policies,
        plan_and_ladder,
        plan_json,
        plot_gpu_plan,
        print_gpu_plan,
        serve_dtype,
    )

    with refusing("advise"):
        if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms are required")
        if args.gpus < 1:
            raise ValueError("--gpus must be >= 1")
        if args.hardware == "cpu" and args.tp and args.tp != "1":
            raise ValueError("--hardware cpu plans TP-1 workers (one core each)")
        given_policies(args)
        if not 0 < args.target <= 1:
            raise ValueError("target attainment must be in (0, 1]")
        model_dir, model_flag = model_source(args)
        spec = spec_from_args(args)
        profiles = given_profiles(args, model_dir)
    if profiles is None:
        profiles = {1: measured_profile(model_dir, args.deploy_cores[0])}
    with refusing("advise"), _bars() as progress:  # computation on the inputs, as `plan` is
        plan, rungs, advice = plan_and_ladder(profiles, spec, args, progress)
    dtype = serve_dtype(profiles)
    print_gpu_plan(plan, rungs, advice, model_flag, dtype)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checked: dict[str, Any] = {"verified": False, "why": "--no-verify"}
    if args.hardware != "cpu":
        checked = {"verified": False, "why": f"no {args.hardware} here: the plan is analytic"}
    elif not args.no_verify:
        checked = verify(args, plan, out)
    print_verification(checked, plan.best.shape.label)
    doc = plan_json(plan, rungs, advice, model_flag, dtype) | {
        "hardware": args.hardware, "profiles": {tp: p.kind for tp, p in profiles.items()},
        "verification": checked}
    (out / "advise.json").write_text(json.dumps(doc, indent=2))
    png = plot_gpu_plan(plan, rungs, out / "gpuplan.png")
    print(f"wrote {out / 'advise.json'} and {png}")
    return 0


@contextmanager
def _bars() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        def progress(name: str, total: int) -> Callable[[], None]:
            task = bar.add_task(name, total=total)
            return lambda: bar.advance(task)

        yield progress


def register_advise(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitserve.common.cpus import cpus_flag
    from splitserve.sim.cli_args import add_profile_arg

    ad = sub.add_parser("advise", help="my model, my hardware, my traffic: a plan, verified "
                        "where the hardware is here", allow_abbrev=False)
    ad.add_argument("--embedded", action="store_true",
                    help="the embedded demo model (the default without --model)")
    ad.add_argument("--hardware", choices=HARDWARE, default="cpu",
                    help="cpu: this machine (measured profiles, verified live); a GPU preset: "
                    "analytic profiles")
    ad.add_argument("--gpus", type=int, required=True,
                    help="the budget: GPUs, or cores on --hardware cpu")
    ad.add_argument("--tp", help="TP degrees to search (GPU presets; default 1,2,4,8)")
    ad.add_argument("--dtype-bytes", type=int, default=2,
                    help="GPU presets: bytes a weight and KV value (default 2; the deploy "
                    "command serves --dtype bfloat16 for 2, float32 for 4)")
    ad.add_argument("--policies", help="routing policies to search (default: cache,load on "
                    "workloads with repeated prefixes, else cache)")
    ad.add_argument("--target", type=float, default=0.9, help="SLO attainment target")
    ad.add_argument("--no-ladder", action="store_true", help="plan the budget only")
    ad.add_argument("--no-verify", action="store_true", help="cpu: do not start the choice")
    ad.add_argument("--deploy-cores", type=cpus_flag, default=(0, 1),
                    help="cpu: the cores to profile on (the first) and to verify on")
    ad.add_argument("--cache-block-tokens", type=int, default=None,
                    help="prefix-cache block for token-id prompts (default: 128 on cpu, 16 on "
                    "GPUs)")
    ad.add_argument("--out-dir", default="advise")
    add_profile_arg(ad, "--hardware cpu: plan with this profile JSON (splitserve profile) "
                    "instead of profiling a worker of the model here")
    add_workload_arguments(ad, model_help=(
        "the model to plan for: a directory, its config.json or a Hugging Face model id (GPU "
        "presets: sizes the analytic profiles; cpu: profiled and verified here; default: "
        "the embedded model)"))
    ad.set_defaults(func=run_advise)
