"""`splitserve` command line: one subcommand per part, each registered by its own module.

Each module listed in `COMMAND_MODULES` exposes `register(subparsers)`, which adds its
subcommands and sets `func` (a callable taking the parsed namespace and returning an exit code).
A command refuses bad input by raising `Refused` (`splitserve.common.refusal`): `main` prints
its one line and returns 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from splitserve.common.refusal import Refused, refuse

COMMAND_MODULES = (
    "splitserve.worker.cli",  # worker
    "splitserve.demo",  # demo
    "splitserve.router.cli",  # router
    "splitserve.launch.cli",  # serve
    "splitserve.bench.cli",  # bench, bench compare
    "splitserve.sim.cli",  # profile, sim, sim validate, plan, advise
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Prefill/decode disaggregated LLM serving on vLLM.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a part not installed in this build
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # everything after `--` is passed through (e.g. to vLLM)
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if extra:
        args.vllm_args = extra
    try:
        return int(args.func(args) or 0)
    except Refused as exc:  # bad input, refused before the command's real work
        return refuse(exc.command, exc.why)


if __name__ == "__main__":
    sys.exit(main())
