"""`splitserve profile`, `splitserve sim`, `splitserve sim validate` and `splitserve plan`.

    splitserve profile --url URL --out profile.json          # measure a running vLLM worker
    splitserve profile --analytic --model-config DIR --hardware h100-sxm --out gpu.json
    splitserve profile --split --url ROUTER --base P.json --out P-split.json  # 1P+1D costs
    splitserve sim --profile P.json --mode disagg --prefill 1 --decode 3 [workload] --out r.json
    splitserve sim validate --profile P.json --rates 1,2 --repeats 3 [--url URL] [workload]
    splitserve profile --add-links P.json --nixl-probe --out P.json   # + a measured nixl link
    splitserve profile --add-links P.json --mooncake-probe --out P.json   # + a mooncake link
    splitserve plan --profile P.json --workers 8 --request-rate 4 --slo-ttft-ms 1000 \\
        --slo-tpot-ms 50 [--connector splitserve|nixl|compare] [workload] --out-dir plan/
        (`sim.plan_cli`)

Workload options are the benchmark's (`splitserve bench --help`), so a simulated and a measured
run of the same options see the same stream, and results use the benchmark's JSON schema.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from splitserve.bench.cli import add_workload_arguments, spec_from_args
from splitserve.bench.metrics import SLO, distserve_goodput
from splitserve.bench.report import print_summary, progress_bars, save_result
from splitserve.common.cpus import cpus_flag
from splitserve.common.refusal import refusing
from splitserve.sim.advise import register_advise
from splitserve.sim.cli_args import (
    add_deployment_args,
    add_profile_arg,
    cache_block_tokens,
    cli_profile,
    model_path,
    transport_for,
)
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import VLLM_CPU_TOKEN_BUDGET, Profile, load_profile, save_profile
from splitserve.sim.plan_cli import register_plan


def _sim_config(args: argparse.Namespace, prof: Profile) -> SimConfig:
    split = prof.split is not None and args.connector == "splitserve"
    if args.mode == "disagg" and not split and not args.no_split_costs:
        print("note: no split costs apply (the profile's, from splitserve profile --split, are "
              "splitserve's connector's): router and connector CPU are not modelled, so "
              "disaggregated latencies are lower bounds")
    return SimConfig(mode=args.mode, n_prefill=args.prefill, n_decode=args.decode,
                     n_workers=args.workers, token_budget=args.token_budget,
                     p_policy=args.p_policy, d_policy=args.d_policy,
                     transport=transport_for(args, prof, args.connector),
                     connector=args.connector, pull_request_s=args.pull_request_ms / 1000,
                     overlap=not args.no_overlap, shared_link=args.shared_link,
                     router_hop_s=args.router_hop_ms / 1000, seed=args.seed,
                     split_costs=not args.no_split_costs,
                     prefix_caching=not args.no_prefix_caching, cache_aware=not args.cache_blind,
                     local_prefill_max_tokens=args.local_prefill_max_tokens,
                     index_lag_s=(args.index_lag_ms or 0.0) / 1000)


def _label(cfg: SimConfig) -> str:
    if cfg.mode == "disagg":
        return f"sim:{cfg.n_prefill}P{cfg.n_decode}D"
    return f"sim:{cfg.mode}x{cfg.n_workers}"


Job = Callable[[], Profile]  # a profile's measurement, its inputs already read and checked


def _with_links(args: argparse.Namespace) -> Job:
    """`--add-links`: links measured by the job (and `--transfer-json`'s and `--nixl-json`'s,
    read now), onto an existing profile."""
    from splitserve.sim.links import (
        links_from_benchmark,
        measured_links,
        nixl_link_from_side_by_side,
    )
    from splitserve.sim.profile import nixl_desc_bytes

    prof = load_profile(args.add_links)
    desc = nixl_desc_bytes(prof.model, args.block_size)
    given = links_from_benchmark(args.transfer_json) if args.transfer_json else {}
    probes = not args.no_tcp_probe or args.nixl_probe or args.mooncake_probe
    if not (probes or given or args.nixl_json):
        raise ValueError("--add-links: nothing to measure (--nixl-probe, --mooncake-probe, "
                         "--nixl-json, --transfer-json, or the tcp probe)")
    if args.nixl_json:  # vLLM's own pulls replace the probe's transport numbers
        given["nixl"], beyond = nixl_link_from_side_by_side(
            args.nixl_json, prof.model.kv_bytes_per_token)
        if beyond is not None:
            print(f"D's leg beyond its pull (request round trip and replay step): median "
                  f"{beyond * 1e3:.1f} ms; less D's step, that is --pull-request-ms")

    def measure() -> Profile:
        links = measured_links(None, not args.no_tcp_probe, desc if args.nixl_probe else None,
                               desc if args.mooncake_probe else None)
        return replace(prof, transfer=prof.transfer | links | given)

    return measure


def _analytic(args: argparse.Namespace) -> Profile:
    """`--analytic`: a roofline profile from a model config and a hardware preset."""
    from splitserve.sim.analytic import PRESETS, ModelConfig, analytic_profile

    if not args.model_config:
        raise ValueError("--analytic needs --model-config")
    hw = PRESETS[args.hardware]
    overrides: dict[str, Any] = {k: v for k, v in (
        ("flops", args.flops), ("mem_bw", args.mem_bw), ("link_bw", args.link_bw),
        ("memory_bytes", args.memory_bytes)) if v is not None}
    model = ModelConfig.from_hf(model_path(args.model_config) or "", args.dtype_bytes)
    if not Path(args.model_config).exists():  # a hub id: named by it, not its snapshot
        model = replace(model, name=args.model_config)
    return analytic_profile(model, replace(hw, **overrides), args.token_budget, tp=args.tp)


def _measured(args: argparse.Namespace) -> Job:
    """A running worker (`--url`) profiled through the bench client by the job; its model is
    resolved and `--transfer-json` read now (the job reads it again once it has measured)."""
    from splitserve.sim.links import links_from_benchmark
    from splitserve.sim.profile import ProfilePlan, profile_worker

    if not args.url:
        raise ValueError("give --url of a running worker, or --analytic")
    plan = ProfilePlan(token_budget=args.token_budget or VLLM_CPU_TOKEN_BUDGET)
    if args.quick:
        plan = replace(plan, prefill_lens=(16, 256, 1024, 2048), prefill_repeats=2,
                       decode_batches=(1, 4, 8), decode_prompt_lens=(32, 1024))
    model_dir = model_path(args.model_dir)
    if args.transfer_json:
        links_from_benchmark(args.transfer_json)

    def measure() -> Profile:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn()) as bar:
            task = bar.add_task("profile: grid steps measured", total=None)
            return profile_worker(args.url, plan, model_dir, args.transfer_json,
                                  probe_tcp=not args.no_tcp_probe, probe_nixl=args.nixl_probe,
                                  probe_mooncake=args.mooncake_probe,
                                  progress=lambda done, total: bar.update(
                                      task, completed=done, total=total))

    return measure


def _profile_job(args: argparse.Namespace) -> Job:
    """The profile `args` ask for, as a job: every input read and checked now (ValueError,
    OSError); what measures (a worker, a router, the link probes) left to the job. A profile
    computed from its inputs alone (`--refit`, `--analytic`) is computed now."""
    if args.mooncake_probe:
        from splitserve.worker.kv_transfer import check_mooncake_installed

        check_mooncake_installed("splitserve profile --mooncake-probe")
    if args.add_links:
        return _with_links(args)
    if args.refit:  # a split profile's split costs, else a plain profile's fits
        from splitserve.sim.calibration.calibrate import refit_split
        from splitserve.sim.profile import refit

        old = load_profile(args.refit)
        fitted = refit_split(old) if old.split is not None else refit(old)
        return lambda: fitted
    if args.split:
        from splitserve.sim.calibration.calibrate import SplitPlan, calibrate_split

        if not (args.url and args.base):
            raise ValueError("--split needs --url (a router) and --base")
        base = load_profile(args.base)
        return lambda: calibrate_split(args.url, base, SplitPlan())
    if args.analytic:
        derived = _analytic(args)
        return lambda: derived
    return _measured(args)


def run_profile(args: argparse.Namespace) -> int:
    """Inputs refused in one line (`refusing`); a measurement's errors keep their traceback."""
    with refusing("profile"):
        job = _profile_job(args)
    prof = job()
    save_profile(prof, args.out)
    print(f"{prof.kind} profile of {prof.model.name} on {prof.engine.name} "
          f"{prof.engine.version}: prefill {prof.prefill}, decode {prof.decode}, "
          f"KV {prof.kv_capacity_tokens} tokens; wrote {args.out}")
    for name, link in sorted(prof.transfer.items()):
        print(f"link {name}: {link.bandwidth_Bps / 1e9:.3f} GB/s + {link.latency_s * 1e3:.3f} ms "
              f"({link.source})")
    if prof.split is not None:
        print(f"split costs: {prof.split.__dict__ | {'fit': '...'}}")
    if prof.fit:
        for part in ("prefill", "decode"):
            q = prof.fit[f"{part}_fit"]
            print(f"{part} fit: median |relative error| {q['median_abs_rel_error']:.1%}, "
                  f"max {q['max_abs_rel_error']:.1%}, outliers dropped {q['dropped']}")
    return 0


def _decode_profile(args: argparse.Namespace) -> Profile | None:
    """`--decode-profile`: D's workers, when they are not `--profile`'s (disagg only)."""
    if not args.decode_profile:
        return None
    if args.mode != "disagg":
        raise ValueError("--decode-profile is for --mode disagg (the D pool's workers)")
    return cli_profile(argparse.Namespace(
        profile=args.decode_profile, accept_profile_mismatch=args.accept_profile_mismatch))


@refusing("sim")  # computation on its inputs alone: all of it refuses them
def run_sim(args: argparse.Namespace) -> int:
    from splitserve.sim.records import MAX_RECORDS, request_records
    from splitserve.sim.results import summarize
    from splitserve.sim.run import simulate
    from splitserve.sim.workload import arrays_from_spec

    prof, spec = cli_profile(args), spec_from_args(args)
    cfg = _sim_config(args, prof)
    d_prof = _decode_profile(args)
    block = cache_block_tokens(args, prof)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    rates = sorted(args.sweep_rates) or [None]
    if rates[0] is not None and slo.empty:
        raise ValueError("a rate sweep needs an SLO (--slo-ttft-ms and/or --slo-tpot-ms)")
    if rates[0] is not None and (why := spec.unpaced):
        raise ValueError(f"--sweep-rates: {why}")
    points = []
    sweep = progress_bars() if len(rates) > 1 else nullcontext(None)
    with sweep as bars:  # a bar over the sweep's rates, as `bench` shows its runs
        advance = bars(f"{_label(cfg)} rates", len(rates)) if bars else None
        for rate in rates:  # a sweep ends on its highest rate, as the benchmark's does
            run_spec = spec if rate is None else spec.with_rate(rate)
            out = simulate(prof, cfg, arrays_from_spec(run_spec, block), d_prof)
            res = summarize(out, system=_label(cfg), slo=slo)
            points.append({"rate": rate} | {k: res.get(k) for k in (
                "slo_attainment", "request_goodput", "request_throughput", "completed",
                "failed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                "median_tpot_ms")})
            if advance is not None:
                advance(None)  # type: ignore[arg-type]
    if rates[0] is not None:
        goodput = distserve_goodput([(p["rate"], p["slo_attainment"]) for p in points])
        res["sweep"] = {"points": points, "distserve_goodput": goodput,
                        "rate_unit": spec.rate_unit}
        res["distserve_goodput"] = goodput["value"]
    if len(out.arrivals) <= MAX_RECORDS:  # per-request records for the bench report's plots
        res["requests"] = [r.to_dict() for r in request_records(out)]
    res["sim"] = {"profile": str(args.profile), "profile_kind": prof.kind,
                  "profile_mismatch": prof.mismatch, "config": cfg.__dict__,
                  "workload": spec.to_dict()}
    print_summary({res["system"]: res})
    if args.out:
        save_result(res, args.out)
        print(f"wrote {args.out}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """The inputs refused in one line (`refusing`); the measurements (a worker or deployment
    started, profiled, calibrated, benchmarked) keep their errors' tracebacks."""
    from splitserve.sim.validate_cli import Validation

    with refusing("sim validate"):
        prof, spec = cli_profile(args), spec_from_args(args)
        cfg = _sim_config(args, prof)
        if not args.prefix_caching:  # the engines validation starts keep no prefix cache (its
            cfg = replace(cfg, prefix_caching=False)  # repeats replay one stream): nor the sim
        validation = Validation(args, prof, spec, cfg, cache_block_tokens(args, prof))
        if args.real_json:  # nothing measured: the stored runs simulated again
            return validation.run()
    return validation.run()


def _rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _register_profile(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prof = sub.add_parser("profile", help="measure a worker's step costs (or derive them)")
    prof.add_argument("--url", help="a running vLLM worker's base URL")
    prof.add_argument("--out", default="profile.json")
    prof.add_argument("--model-dir", help="model directory or Hugging Face model id (default: "
                      "the worker's model root)")
    prof.add_argument("--token-budget", type=int, default=None,
                      help="the worker's max_num_batched_tokens (default: vLLM's, 2048 on "
                      "CPU; with --analytic, vLLM's default on that GPU)")
    prof.add_argument("--transfer-json", help="KV transfer benchmark JSON (per-transport links)")
    prof.add_argument("--no-tcp-probe", action="store_true")
    prof.add_argument("--nixl-probe", action="store_true", help="add a `nixl` link: NIXL READs "
                      "DRAM->DRAM between two local agents (the transport, loopback)")
    prof.add_argument("--mooncake-probe", action="store_true", help="add a `mooncake` link: "
                      "Mooncake transfer-engine WRITEs DRAM->DRAM over tcp between two local "
                      "engines (the engine, loopback; needs the `mooncake` extra)")
    prof.add_argument("--add-links", metavar="PROFILE", help="measure links (tcp probe, "
                      "--nixl-probe, --mooncake-probe, --transfer-json) onto an existing "
                      "profile; no worker")
    prof.add_argument("--nixl-json", help="--add-links: the `nixl` link from vLLM's own pulls "
                      "in benchmarks/nixl_side_by_side.py's JSON (replaces --nixl-probe's)")
    prof.add_argument("--block-size", type=int, default=128, help="--add-links with a probe: "
                      "the workers' KV block size (tokens; vLLM-CPU: 128)")
    prof.add_argument("--quick", action="store_true", help="a smaller measurement grid")
    prof.add_argument("--refit", metavar="PROFILE", help="fit a measured profile's points again "
                      "(a calibrated split profile: its split costs, from the records it keeps)")
    prof.add_argument("--split", action="store_true", help="measure a disaggregated "
                      "deployment's extra costs through its router (--url) on top of --base")
    prof.add_argument("--base", metavar="PROFILE", help="the plain workers' profile (--split)")
    g = prof.add_argument_group("analytic (GPU) profile")
    g.add_argument("--analytic", action="store_true")
    g.add_argument("--model-config", help="HF config.json, its directory, or a Hugging Face "
                   "model id")
    g.add_argument("--hardware", default="h100-sxm",
                   choices=("a100-80g", "h100-sxm", "h200", "l40s"))
    g.add_argument("--dtype-bytes", type=int, default=2)
    g.add_argument("--flops", type=float, default=None, help="override peak FLOP/s")
    g.add_argument("--mem-bw", type=float, default=None, help="override bytes/s")
    g.add_argument("--memory-bytes", type=float, default=None)
    g.add_argument("--link-bw", type=float, default=None, help="override P→D bytes/s per GPU")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs a worker (1..8, "
                   "within one node; all-reduce costs from the preset's NVLink)")
    prof.set_defaults(func=run_profile)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_profile(sub)
    sim = sub.add_parser("sim", help="simulate a deployment on a workload")
    add_profile_arg(sim)
    sim.add_argument("--decode-profile", help="the D pool's profile when its workers differ "
                     "from --profile's (e.g. another --tp of the same model)")
    add_deployment_args(sim)
    add_workload_arguments(sim)
    sim.add_argument("--out", help="result JSON (the benchmark's schema)")
    sim.set_defaults(func=run_sim)
    ssub = sim.add_subparsers(dest="sim_command")
    val = ssub.add_parser("validate", help="measured vs simulated, per metric and load")
    add_profile_arg(val)
    add_deployment_args(val)
    add_workload_arguments(val)
    val.add_argument("--rates", type=_rates, action="extend", default=None,
                     help="load levels, e.g. 0.5,1,2 (repeatable: each adds its levels)")
    val.add_argument("--url", help="a running deployment (default: start one: a plain worker "
                     "for --mode chunked --workers 1, else splitserve's launcher)")
    val.add_argument("--model-dir", help="model directory or Hugging Face model id for the "
                     "local worker (default: embedded)")
    val.add_argument("--cpus", type=cpus_flag,
                     help="cores for the local worker or deployment, e.g. 0,1")
    val.add_argument("--router-cpus", type=cpus_flag,
                     help="cores for the deployment's router, e.g. 1")
    val.add_argument("--client-cpus", type=cpus_flag,
                     help="cores for this command (the benchmark client), e.g. 1")
    val.add_argument("--reprofile", action="store_true",
                     help="profile the local worker first and simulate with that profile")
    val.add_argument("--calibrate", action="store_true",
                     help="disagg: measure the launched deployment's split costs first")
    val.add_argument("--real-json", help="reuse the measurements of an earlier validation JSON "
                     "(simulate again only)")
    val.add_argument("--prefix-caching", action="store_true",
                     help="validate the prefix-cache model: the engines keep their caches "
                     "(--enable-prompt-tokens-details), every repeat runs a fresh seed's stream, "
                     "simulated with caches and the router's --p-policy/--d-policy, "
                     "--cache-blind, --local-prefill-max-tokens")
    val.add_argument("--out", help="validation JSON")
    val.set_defaults(func=run_validate)

    register_plan(sub)
    register_advise(sub)
