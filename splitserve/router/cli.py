"""`splitserve router`: the OpenAI-compatible front door over P/D (or colocated) workers.

The deployment token comes from `SPLITSERVE_TOKEN` or `SPLITSERVE_TOKEN_FILE`; an optional API key
for clients from `SPLITSERVE_API_KEY`. Neither is ever a command-line argument.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from splitserve.common.ports import check_port_free
from splitserve.common.refusal import refusing
from splitserve.config import load_token
from splitserve.router.config import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    UNSPLITTABLE_MODES,
    RouterConfig,
)
from splitserve.routing import DEFAULT_POLICY
from splitserve.routing.prefix import LOCAL_PREFILL_MAX_TOKENS
from splitserve.secretflags import API_KEY_ENV, add_secret_guards


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    # extend: `--prefill A --prefill B` is both (argparse's plain nargs would keep only B)
    p.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL",
                   help="prefill workers (repeatable)")
    p.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                   help="decode workers (repeatable)")
    p.add_argument("--colocated", action="extend", nargs="+", default=[], metavar="URL",
                   help="colocated workers (plain load balancing; also run unsplittable "
                        "requests; repeatable)")
    p.add_argument("--peer", action="extend", nargs="+", default=[], metavar="URL",
                   dest="peers",
                   help="the other routers in front of the same workers: each one's open "
                        "legs count in this router's balance (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None,
                   help="model directory or Hugging Face model id, for the tokenizer and chat "
                        "template (default: the workers' model directory)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face --model (default: main)")
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=DEFAULT_POLICY,
                   help="how P is chosen (default cache: the prompt tokens it would still "
                        "compute after its cached prefix, plus those queued on it)")
    p.add_argument("--decode-policy", choices=DECODE_POLICIES, default=DEFAULT_POLICY,
                   help="how D is chosen (default cache: load, less its cached prefix of "
                        "the prompt)")
    p.add_argument("--prefill-hit-weight", type=float, default=1.0, metavar="W",
                   help="cache policy, P: a cached prompt token counts as W tokens not to "
                        "compute, against the tokens queued there (default 1)")
    p.add_argument("--decode-hit-weight", type=float, default=1.0, metavar="W",
                   help="cache policy, D: a whole prompt cached is worth W of load's score "
                        "(KV fraction + staging fraction + open legs / 16; default 1)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=LOCAL_PREFILL_MAX_TOKENS,
                   metavar="N",
                   help="prefill on D: a request whose chosen D holds all but at most N of "
                        "its prompt tokens runs whole on that D, with no P leg and no "
                        f"transfer (default {LOCAL_PREFILL_MAX_TOKENS}; 0: never)")
    p.add_argument("--unsplittable", choices=UNSPLITTABLE_MODES, default="whole",
                   help="requests the two-leg flow cannot honour exactly: run whole on one "
                        "worker, or refuse with 400")
    p.add_argument("--kv-transport", choices=("tcp", "shm"), default=None,
                   help="transport for every transfer (default: what each D advertises)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds per check")
    p.add_argument("--unhealthy-after", type=int, default=3,
                   help="consecutive failures (checks or connection-level errors) before a "
                        "worker leaves rotation")
    p.add_argument("--healthy-after", type=int, default=2,
                   help="consecutive good checks before it returns")
    p.add_argument("--prefill-retries", type=int, default=2,
                   help="extra attempts on another P before the first token")
    p.add_argument("--whole-retries", type=int, default=None,
                   help="extra attempts of an unsplit request on another worker before its "
                        "first byte (default: as --prefill-retries)")
    p.add_argument("--decode-retries", type=int, default=2,
                   help="resumptions of a broken decode stream on another D")
    p.add_argument("--max-inflight", type=int, default=4096, help="429 above this many requests")
    p.add_argument("--max-inflight-per-worker", type=int, default=256,
                   help="queue limit per worker: 429 when every worker of a pool is at it")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024**2,
                   help="413 for larger request bodies")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: stop accepting, give in-flight requests this long, exit")
    p.add_argument("--log-level", default="info")
    add_secret_guards(p)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    from splitserve.hub import resolve_model

    model_dir = resolve_model(args.model, args.revision).path if args.model else None
    return RouterConfig(
        prefill=tuple(args.prefill), decode=tuple(args.decode), colocated=tuple(args.colocated),
        peers=tuple(args.peers), host=args.host, port=args.port, model_dir=model_dir,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        prefill_hit_weight=args.prefill_hit_weight, decode_hit_weight=args.decode_hit_weight,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        unsplittable=args.unsplittable, kv_transport=args.kv_transport,
        health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
        unhealthy_after=args.unhealthy_after, healthy_after=args.healthy_after,
        prefill_retries=args.prefill_retries, decode_retries=args.decode_retries,
        whole_retries=(args.prefill_retries if args.whole_retries is None
                       else args.whole_retries),
        max_inflight=args.max_inflight, max_inflight_per_worker=args.max_inflight_per_worker,
        max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout,
    )


def serve(cfg: RouterConfig, token: str | None, api_key: str | None,
          log_level: str = "info") -> None:
    import uvicorn

    from splitserve.router.app import create_app

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM/SIGINT: uvicorn stops accepting at once, lets in-flight requests (streams
    # included) finish for up to the drain timeout, then runs the app's shutdown.
    uvicorn.run(create_app(cfg, token, api_key), host=cfg.host, port=cfg.port,
                log_level=log_level, access_log=False,
                timeout_graceful_shutdown=max(1, round(cfg.drain_timeout_s)))


def run(args: argparse.Namespace) -> int:
    with refusing("router"):
        cfg = config_from_args(args)
        check_port_free(cfg.host, cfg.port)
        token = load_token(required=False)
    if cfg.prefill and not token:
        print("splitserve router: no deployment token (SPLITSERVE_TOKEN or SPLITSERVE_TOKEN_FILE):"
              " workers' KV endpoints cannot be read, so D will recompute every prompt",
              file=sys.stderr)
    serve(cfg, token, os.environ.get(API_KEY_ENV) or None, args.log_level)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the OpenAI-compatible router over P/D workers")
    add_router_arguments(p)
    p.set_defaults(func=run)
