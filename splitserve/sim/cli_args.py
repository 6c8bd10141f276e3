"""The options, profile loading and model resolution that `splitserve profile`, `sim`,
`sim validate` and `plan` share."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.routing.prefix import LOCAL_PREFILL_MAX_TOKENS
from splitserve.sim.deployment import CONNECTORS, MODES, POLICIES
from splitserve.sim.model import Profile, load_profile


def installed_engine() -> str | None:
    from splitserve.common.engine import installed_vllm_version

    return installed_vllm_version()


def model_path(name: str | None) -> str | None:
    """A model directory or config file as given; a Hugging Face model id resolved to its
    snapshot directory (splitserve.hub, as the workers resolve it). ValueError for an id the
    hub does not resolve."""
    if name is None or Path(name).exists():
        return name
    from splitserve.hub import resolve_model

    return resolve_model(name).path


def cli_profile(args: argparse.Namespace) -> Profile:
    """`--profile`, checked against the installed vLLM (see `add_profile_arg`). ValueError
    when it is not given; OSError when it cannot be read."""
    if not args.profile:
        raise ValueError("--profile is required (make one with `splitserve profile`)")
    prof = load_profile(args.profile, engine_version=installed_engine(),
                        accept_mismatch=args.accept_profile_mismatch)
    if prof.mismatch:
        print(f"WARNING: {prof.mismatch}")
    if prof.kind == "analytic":
        print(f"note: {args.profile} is an analytic profile (a roofline estimate, "
              "not a measurement)")
    return prof


def add_profile_arg(p: argparse.ArgumentParser,
                    role: str = "profile JSON (splitserve profile); required") -> None:
    """`--profile` (its help: `role`, what the profile is to this command) and
    `--accept-profile-mismatch`."""
    p.add_argument("--profile", help=role)
    p.add_argument("--accept-profile-mismatch", action="store_true",
                   help="use a profile measured on another vLLM version (flagged)")


def add_connector_args(g: argparse._ArgumentGroup | argparse.ArgumentParser,
                       compare: bool = False) -> None:
    g.add_argument("--connector", choices=CONNECTORS + (("compare",) if compare else ()),
                   default="splitserve",
                   help="disagg KV connector: splitserve (layer-wise push), nixl (D pulls "
                   "after the prefill, then replays t1) or mooncake (D's leg sent with P's; "
                   "P sends the whole blocks when its prefill ends, then D replays t1)"
                   + ("; compare: plan over splitserve and nixl, side by side" if compare
                      else ""))
    g.add_argument("--transport", default=None,
                   help="a link in the profile (default: nixl for --connector nixl, mooncake "
                   "for --connector mooncake when the profile has one, else tcp, else its "
                   "only one)")
    g.add_argument("--pull-request-ms", type=float, default=0.0,
                   help="nixl: D's leg from its arrival at D to D's scheduler (beyond the "
                   "router hop); D's next step then posts the READ")


def transport_for(args: argparse.Namespace, prof: Profile, connector: str) -> str:
    """The profile link a connector uses: `--transport`, else `nixl` for NIXL, `mooncake` for
    Mooncake when the profile has that link (`splitserve profile --mooncake-probe`), else `tcp`
    (or the profile's first link of splitserve's transports): Mooncake's engine moves KV over
    tcp here, so splitserve's measured tcp link stands in for it until one is measured."""
    if args.transport and (connector == "splitserve" or args.connector != "compare"):
        return str(args.transport)
    if connector == "nixl":
        return "nixl"
    if connector == "mooncake" and "mooncake" in prof.transfer:
        return "mooncake"
    others = sorted(t for t in prof.transfer if t not in ("nixl", "mooncake"))
    return "tcp" if "tcp" in prof.transfer or not others else others[0]


def cache_block_tokens(args: argparse.Namespace, prof: Profile) -> int:
    """`--cache-block-tokens`, else the block of the engine the profile stands for.
    ValueError when it is below 1."""
    if args.cache_block_tokens is not None:
        if args.cache_block_tokens < 1:
            raise ValueError("--cache-block-tokens must be >= 1")
        return int(args.cache_block_tokens)
    return 16 if prof.kind == "analytic" else 128


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    """`sim`'s and `sim validate`'s simulated deployment and its prefix caches."""
    g = p.add_argument_group("simulated deployment")
    g.add_argument("--mode", choices=MODES, default="disagg")
    g.add_argument("--prefill", type=int, default=1, help="P-workers (disagg)")
    g.add_argument("--decode", type=int, default=1, help="D-workers (disagg)")
    g.add_argument("--workers", type=int, default=1, help="workers (colocated, chunked)")
    g.add_argument("--token-budget", type=int, default=None, help="default: the profile's")
    g.add_argument("--p-policy", choices=POLICIES, default="power_of_two")
    g.add_argument("--d-policy", choices=POLICIES, default="power_of_two")
    add_connector_args(g)
    g.add_argument("--no-overlap", action="store_true", help="send KV after the prefill")
    g.add_argument("--shared-link", action="store_true", help="one link for all transfers")
    g.add_argument("--router-hop-ms", type=float, default=0.0)
    g.add_argument("--no-split-costs", action="store_true",
                   help="disagg: ignore the profile's measured split costs (router, connector)")
    c = p.add_argument_group("prefix caches (workloads with repeated prefixes: mooncake, "
                             "multiturn, traces)")
    c.add_argument("--no-prefix-caching", action="store_true",
                   help="the engines keep no prefix cache (every prompt computed whole)")
    c.add_argument("--cache-blind", action="store_true",
                   help="the router has no index of the caches: routing by load alone, whole "
                   "transfers, no prefill on D (the engines still reuse what they hold)")
    c.add_argument("--local-prefill-max-tokens", type=int, default=LOCAL_PREFILL_MAX_TOKENS,
                   help="prefill on D when its D holds all but at most this many prompt tokens "
                   f"(the router's flag; default {LOCAL_PREFILL_MAX_TOKENS}; 0: never)")
    c.add_argument("--index-lag-ms", type=float, default=None,
                   help="the router's index sees each cache change this long after it (the "
                   "router measures it: splitserve_router_kv_event_lag_seconds; default 0, "
                   "sim validate: each repeat's measured mean)")
    c.add_argument("--cache-block-tokens", type=int, default=None,
                   help="tokens per cache block for prompts made of token ids (default: 128, "
                   "vLLM-CPU's block, for a measured profile; 16, vLLM's GPU default, for an "
                   "analytic one); Mooncake traces use their own blocks")
