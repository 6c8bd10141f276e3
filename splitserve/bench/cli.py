"""`splitserve bench`, `splitserve bench compare` and `splitserve bench report`.

    splitserve bench --url URL --result-json PATH [workload, SLO, repeat/sweep options]
    splitserve bench compare --url NAME=URL --url NAME=URL --out DIR [same options]
    splitserve bench compare --deploy a=colocated:8192 --deploy b=disagg --out DIR
    splitserve bench compare --deploy cache=disagg:2p2d:cache --deploy load=disagg:2p2d:load …
    splitserve bench report A.json B.json --out DIR
    splitserve bench make-trace --out trace.jsonl [--sessions N --max-turns T …]

`compare` sends the identical stream (same seed, prompts, lengths, arrival times) to every
endpoint in turn — running ones given by URL, and deployments it starts itself one at a time on
the same cores (`--deploy`, see deploy.py) — and writes DIR/NAME.json per system plus
DIR/report.html.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench.client import ClientConfig
from splitserve.bench.deploy import Arm, deployment, parse_arm
from splitserve.bench.metrics import SLO
from splitserve.bench.mooncake import TraceShape, make_trace, write_mooncake
from splitserve.bench.repeat import MooncakeOptions, MultiturnOptions
from splitserve.bench.report import print_summary, progress_bars, save_result, write_report
from splitserve.bench.runner import RunOptions, compare_streams, run_bench
from splitserve.bench.verdict import verdict
from splitserve.bench.workload import (
    ARRIVAL_KINDS,
    INTERFERENCE,
    LENGTH_KINDS,
    SOURCES,
    ArrivalSpec,
    InterferenceMix,
    LengthDist,
    WorkloadSpec,
    build_stream,
)
from splitserve.common.cpus import cpus_flag
from splitserve.common.refusal import Refused, refusing
from splitserve.config import bearer_headers, load_token
from splitserve.hub import ModelSource, resolve_model


def _rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_workload_arguments(p: argparse.ArgumentParser,
                           model_help: str = "model name (default: the endpoint's first)"
                           ) -> None:
    """The workload and measurement flags every command that runs or plans a workload shares;
    `model_help`: what `--model` means to that command."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=SOURCES, default="synthetic")
    g.add_argument("--spec-json", help="a file holding a WorkloadSpec as JSON (overrides the "
                   "options below)")
    g.add_argument("--dataset-path", help="ShareGPT JSON (--workload sharegpt), trace CSV "
                   "(trace) or Mooncake-format JSONL (mooncake)")
    g.add_argument("--num-prompts", type=int, default=100)
    for side, mean in (("input", 128), ("output", 64)):
        g.add_argument(f"--{side}-dist", choices=LENGTH_KINDS, default="fixed")
        g.add_argument(f"--{side}-len", type=int, default=mean, help="fixed length or mean")
        g.add_argument(f"--{side}-min", type=int, default=1)
        g.add_argument(f"--{side}-max", type=int, default=8192)
        g.add_argument(f"--{side}-std", type=float, default=0.0)
    g.add_argument("--arrival", choices=ARRIVAL_KINDS, default="poisson")
    g.add_argument("--request-rate", type=float, default=1.0)
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--ramp-end-rate", type=float, default=None)
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--interference-duration", type=float, default=INTERFERENCE.duration_s)
    g.add_argument("--interference-short-rate", type=float, default=INTERFERENCE.short_rate)
    g.add_argument("--interference-long-period", type=float,
                   default=INTERFERENCE.long_period_s)
    mc, mt = MooncakeOptions(), MultiturnOptions()
    m = p.add_argument_group("mooncake trace (--workload mooncake)")
    m.add_argument("--trace-block-tokens", type=int, default=mc.block_tokens,
                   help="tokens per hash block in the trace")
    m.add_argument("--token-scale", type=float, default=mc.token_scale,
                   help="scale every length by this, keeping hash blocks whole")
    m.add_argument("--time-scale", type=float, default=mc.time_scale,
                   help="arrivals this many times faster")
    m.add_argument("--max-requests", type=int, default=None, help="keep the first N requests")
    m.add_argument("--sample-sessions", type=float, default=None, metavar="FRACTION",
                   help="keep this fraction of prefix trees (seeded)")
    m.add_argument("--shared-block-fraction", type=float, default=mc.shared_fraction,
                   help="a hash id in more than this fraction of requests is shared (not a "
                   "tree of its own)")
    t = p.add_argument_group("multi-turn sessions (--workload multiturn)")
    t.add_argument("--sessions", type=int, default=mt.sessions)
    t.add_argument("--turns", type=int, default=mt.turns, help="turns per session")
    t.add_argument("--system-prompt-tokens", type=int, default=mt.system_tokens,
                   help="the system prompt every session shares")
    t.add_argument("--user-tokens", type=int, default=mt.user_tokens, help="new tokens a turn")
    t.add_argument("--turn-output-tokens", type=int, default=mt.output_tokens)
    t.add_argument("--think-time", type=float, default=mt.think_time_s,
                   help="seconds between an answer's end and the next turn")
    t.add_argument("--session-rate", type=float, default=None,
                   help="sessions per second (default: --request-rate)")

    r = p.add_argument_group("measurement")
    r.add_argument("--model", default=None, help=model_help)
    r.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY")
                   or os.environ.get("OPENAI_API_KEY"),
                   help="Bearer key for the endpoint (default: $SPLITSERVE_API_KEY or "
                        "$OPENAI_API_KEY; prefer the environment: argv is visible to all)")
    r.add_argument("--slo-ttft-ms", type=float, default=None)
    r.add_argument("--slo-tpot-ms", type=float, default=None)
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--sweep-rates", type=_rates, action="extend", default=[],
                   help="e.g. 1,2,4,8 (repeatable: every rate counts)")
    r.add_argument("--cores", type=int, default=None, help="total cores (goodput per core)")
    r.add_argument("--no-vllm-extras", action="store_true",
                   help="omit ignore_eos/return_token_ids (for non-vLLM servers)")
    r.add_argument("--save-token-ids", action="store_true",
                   help="keep every prompt's and answer's token ids in the result's requests")


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    if args.spec_json:
        return WorkloadSpec.from_dict(json.loads(Path(args.spec_json).read_text()))

    def dist(side: str) -> LengthDist:
        return LengthDist(getattr(args, f"{side}_dist"), getattr(args, f"{side}_len"),
                          getattr(args, f"{side}_min"), getattr(args, f"{side}_max"),
                          getattr(args, f"{side}_std"))

    mix = InterferenceMix(duration_s=args.interference_duration,
                          short_rate=args.interference_short_rate,
                          long_period_s=args.interference_long_period,
                          short_input=INTERFERENCE.short_input,
                          short_output=INTERFERENCE.short_output,
                          long_input=INTERFERENCE.long_input,
                          long_output=INTERFERENCE.long_output)
    rate = args.request_rate
    if args.workload == "multiturn" and args.session_rate is not None:
        rate = args.session_rate
    arrival = ArrivalSpec(args.arrival, rate, args.burstiness, args.ramp_end_rate,
                          args.max_concurrency)
    mooncake = MooncakeOptions(args.trace_block_tokens, args.token_scale, args.time_scale,
                               args.max_requests, args.sample_sessions,
                               args.shared_block_fraction)
    multiturn = MultiturnOptions(args.sessions, args.turns, args.system_prompt_tokens,
                                 args.user_tokens, args.turn_output_tokens, args.think_time)
    return WorkloadSpec(source=args.workload, num_requests=args.num_prompts, input=dist("input"),
                        output=dist("output"), arrival=arrival, interference=mix,
                        path=args.dataset_path, seed=args.seed, warmup=args.warmup,
                        mooncake=mooncake, multiturn=multiturn)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    return RunOptions(slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms), repeats=args.repeats,
                      sweep_rates=tuple(args.sweep_rates), total_cores=args.cores)


def discover_workers(url: str, api_key: str | None = None) -> tuple[dict[str, str], Any]:
    """Worker `/metrics` URLs to sample: a router's `/workers` list, else the URL itself."""
    headers = bearer_headers(api_key)
    try:
        resp = httpx.get(f"{url.rstrip('/')}/workers", headers=headers, timeout=5.0)
        if resp.status_code == 200:
            body = resp.json()
            items = body.get("workers", body) if isinstance(body, dict) else body
            found = {f"{w.get('role', 'worker')}:{w['url']}": w["url"]
                     for w in items if isinstance(w, dict) and w.get("url")}
            if found:
                keep = ("url", "role", "kv_endpoint")
                return found, [{k: w.get(k) for k in keep} for w in items if isinstance(w, dict)]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return {"endpoint": url}, None


def _deployment(url: str, text: str | None, workers: Any) -> dict[str, Any]:
    dep: dict[str, Any] = {"url": url}
    if text:
        try:
            dep |= json.loads(text)
        except json.JSONDecodeError:
            dep["description"] = text
    if workers is not None:
        dep["workers"] = workers
    return dep


async def _bench_one(name: str, url: str, args: argparse.Namespace,
                     deployment: dict[str, Any], progress: Any,
                     worker_token: str | None = None) -> dict[str, Any]:
    metrics_urls, workers = discover_workers(url, args.api_key)
    if workers is not None:
        deployment = deployment | {"workers": workers}
    client = ClientConfig(url=url, model=args.model, api_key=args.api_key,
                          vllm_extras=not args.no_vllm_extras, run_tag=name,
                          save_token_ids=args.save_token_ids)
    # Workers' /metrics need the deployment token: the one we started, else the environment's;
    # an endpoint that is itself the worker takes the key that lets us use it.
    token = worker_token or load_token(False) or (args.api_key if workers is None else None)
    opts = replace(options_from_args(args), worker_token=token)
    return await run_bench(client, spec_from_args(args), name, deployment, metrics_urls, opts,
                           progress)


def _bench_all(args: argparse.Namespace, endpoints: dict[str, str],
               descriptions: dict[str, str], arms: list[Arm]) -> dict[str, dict[str, Any]]:
    """Endpoints given by URL, then deployments started here (one at a time, same stream)."""
    results: dict[str, dict[str, Any]] = {}
    with refusing("bench"):  # the workload's options, checked before anything runs
        spec = spec_from_args(args)
    if args.sweep_rates and (why := spec.unpaced):
        raise Refused("bench", f"--sweep-rates: {why}")
    model = deploy_model(args.deploy_model, args.revision) if arms else None
    with progress_bars() as progress:
        for name, url in endpoints.items():
            dep = _deployment(url, descriptions.get(name), None)
            results[name] = asyncio.run(_bench_one(name, url, args, dep, progress))
        if model is not None:
            log_dir = Path(tempfile.mkdtemp(prefix="splitserve-bench-logs-"))
            longest = max(r.input_len for r in build_stream(spec))
            for arm in arms:
                with deployment(model, arm, log_dir) as ep:
                    dep = arm.description(longest) | {
                        "url": ep.url, "model_dir": model.path, "model": model.name,
                        "revision": model.revision} | ep.info
                    results[arm.name] = asyncio.run(_bench_one(arm.name, ep.url, args, dep,
                                                               progress, ep.token))
    return results


def deploy_model(model: str | None, revision: str | None) -> ModelSource:
    """What every started arm loads: the embedded model, a directory, or a hub id's snapshot,
    resolved once at one commit, so every arm loads the same files. `Refused` for a model it
    cannot resolve."""
    if model is None:
        from splitserve.demo_model import embedded_model_dir

        return ModelSource(str(embedded_model_dir()))
    with refusing("bench compare"):
        return resolve_model(model, revision)


def run_single(args: argparse.Namespace) -> int:
    if not args.url or not args.result_json:
        raise Refused("bench", "--url and --result-json are required")
    results = _bench_all(args, {args.system: args.url}, {args.system: args.deployment}, [])
    save_result(results[args.system], args.result_json)
    if args.report_dir:
        write_report(results, args.report_dir)
    print_summary(results)
    return 0


_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_named_url(text: str) -> tuple[str, str]:
    """NAME=URL (NAME: letters, digits, _ . -)."""
    name, sep, url = text.partition("=")
    if not sep or not _NAME.match(name) or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def run_compare(args: argparse.Namespace) -> int:
    endpoints = dict(args.url or [])
    try:
        arms = [parse_arm(text, args.deploy_cores, args.speculative_config)
                for text in args.deploy or []]
    except ValueError as exc:
        raise Refused("bench compare", f"--deploy: {exc}") from exc
    if len(endpoints) + len(arms) < 2:
        raise Refused("bench compare", "give at least two of --url NAME=URL and --deploy "
                      "NAME=KIND")
    results = _bench_all(args, endpoints, dict(args.deployment or []), arms)
    out = Path(args.out)
    for name, res in results.items():
        save_result(res, out / f"{name}.json")
    line = verdict(results)
    if not compare_streams(list(results.values())):
        line += " (WARNING: the systems did not see the identical stream)"
    path = write_report(results, out, line)
    print_summary(results, line)
    print(f"wrote {path}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    results = {}
    for p in args.results:
        res = json.loads(Path(p).read_text())
        results[res.get("system") or Path(p).stem] = res
    line = verdict(results) if len(results) > 1 else None
    path = write_report(results, args.out, line)
    print_summary(results, line)
    print(f"wrote {path}")
    return 0


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def run_make_trace(args: argparse.Namespace) -> int:
    shape = TraceShape(sessions=args.sessions, max_turns=args.max_turns,
                       system_blocks=args.system_blocks, session_rate=args.session_rate,
                       think_s=args.think_time, user_min=args.user_tokens[0],
                       user_max=args.user_tokens[1], output_min=args.output_tokens[0],
                       output_max=args.output_tokens[1], block_tokens=args.block_tokens)
    rows = make_trace(shape, args.seed)
    path = write_mooncake(rows, args.out)
    print(f"wrote {len(rows)} requests of {shape.sessions} sessions to {path}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint",
                           allow_abbrev=False)
    bench.add_argument("--url", help="endpoint base URL, e.g. http://127.0.0.1:8000")
    bench.add_argument("--result-json", help="where to write the result JSON")
    bench.add_argument("--system", default="system", help="name of the system under test")
    bench.add_argument("--deployment", default=None,
                       help="deployment description for the run sheet (JSON or text)")
    bench.add_argument("--report-dir", default=None, help="also write plots + report.html here")
    add_workload_arguments(bench)
    bench.set_defaults(func=run_single)
    bsub = bench.add_subparsers(dest="bench_command")

    cmp_ = bsub.add_parser("compare", help="the same stream against two or more endpoints",
                          allow_abbrev=False)
    cmp_.add_argument("--url", type=parse_named_url, action="append", metavar="NAME=URL",
                      help="an endpoint that is already running")
    cmp_.add_argument("--deploy", action="append", metavar="NAME=KIND",
                      help="a deployment to start here, fresh (cold caches), one at a time, on "
                      "--deploy-cores: NAME=colocated[:TOKEN_BUDGET] or NAME=disagg[:FIELD...] "
                      "with FIELDs in any order: shm|tcp|nixl|mooncake (KV path; nixl, "
                      "mooncake: vLLM's NixlConnector, MooncakeConnector), <P>p<D>d (default "
                      "1p1d), POLICY or PREFILL/DECODE policies (default cache), blind, spec "
                      "(D drafts with --speculative-config), e.g. cache=disagg:shm:2p2d:cache "
                      "load=disagg:shm:2p2d:load")
    cmp_.add_argument("--speculative-config", default=None, metavar="JSON",
                      help="vLLM's speculative config for the --deploy arms marked `spec` "
                      "(their D, or their colocated worker)")
    cmp_.add_argument("--deploy-cores", type=cpus_flag, default=(0, 1),
                      help="cores every started deployment gets (equal total cores)")
    cmp_.add_argument("--deploy-model", "--model-dir", dest="deploy_model", default=None,
                      metavar="MODEL", help="model for started deployments: a directory or a "
                      "hub id, resolved once and served under that id as vLLM does (default: "
                      "the embedded model)")
    cmp_.add_argument("--revision", default=None,
                      help="the hub id's revision (branch, tag or commit; default: main)")
    cmp_.add_argument("--deployment", type=lambda s: tuple(s.split("=", 1)), action="append",
                      metavar="NAME=DESCRIPTION", help="per-endpoint deployment description")
    cmp_.add_argument("--out", default="bench-results", help="output directory")
    add_workload_arguments(cmp_)
    cmp_.set_defaults(func=run_compare)

    rep = bsub.add_parser("report", help="rebuild plots + report.html from result JSON files",
                         allow_abbrev=False)
    rep.add_argument("results", nargs="+")
    rep.add_argument("--out", default="bench-results")
    rep.set_defaults(func=run_report)

    mk = bsub.add_parser("make-trace", help="write a seeded Mooncake-format trace of "
                         "conversations (see mooncake.TraceShape)", allow_abbrev=False)
    shape = TraceShape()
    mk.add_argument("--out", required=True, help="the JSONL file to write")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--sessions", type=int, default=shape.sessions)
    mk.add_argument("--max-turns", type=int, default=shape.max_turns)
    mk.add_argument("--system-blocks", type=int, default=shape.system_blocks,
                    help="shared blocks every prompt starts with")
    mk.add_argument("--session-rate", type=float, default=shape.session_rate,
                    help="sessions per second")
    mk.add_argument("--think-time", type=float, default=shape.think_s,
                    help="mean seconds between a session's turns")
    mk.add_argument("--user-tokens", type=_pair, default=(shape.user_min, shape.user_max),
                    metavar="MIN,MAX", help="new tokens a turn")
    mk.add_argument("--output-tokens", type=_pair,
                    default=(shape.output_min, shape.output_max), metavar="MIN,MAX")
    mk.add_argument("--block-tokens", type=int, default=shape.block_tokens)
    mk.set_defaults(func=run_make_trace)
