"""The options, profile loading and model resolution that `splitserve profile`, `sim`,
`sim validate` and `plan` share."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from splitserve.sim.deployment import CONNECTORS
from splitserve.sim.model import Profile, load_profile

Command = Callable[[argparse.Namespace], int]


def refusing_bad_input(name: str) -> Callable[[Command], Command]:
    """A command (`name`: `sim`, `plan`, ...) whose bad input (a ValueError: an invalid
    option or workload; an OSError: a file it cannot read) ends in one line on stderr,
    `splitserve NAME: message`, and exit status 2, as argparse's own errors do, not in a
    traceback."""

    def wrap(run: Command) -> Command:
        @functools.wraps(run)
        def refusing(args: argparse.Namespace) -> int:
            try:
                return run(args)
            except (ValueError, OSError) as exc:
                print(f"splitserve {name}: {exc}", file=sys.stderr)
                return 2

        return refusing

    return wrap


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
