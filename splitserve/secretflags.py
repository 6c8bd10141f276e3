"""Flags that would put a secret on a command line, refused with where the secret goes instead.

A command line is readable by every user of the machine (`ps`, `/proc/<pid>/cmdline`) and is
kept in shell history and in vLLM's logged arguments, so splitserve takes secrets only from the
environment. A vLLM user reaches for vLLM's flags (`--api-key`, `--hf-token`); on `splitserve
worker`, `serve` and `router`, and among the arguments passed through to vLLM after `--`, these
get an error naming the variable, not argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from splitserve.config import TOKEN_ENV, TOKEN_FILE_ENV

API_KEY_ENV = "SPLITSERVE_API_KEY"

# flag -> where that secret is taken from
SECRET_FLAGS: dict[str, str] = {
    "--api-key": f"set {API_KEY_ENV} in the router's environment (`splitserve serve` passes it "
                 f"on): clients send it as a Bearer token; workers need no key of their own, "
                 f"they require the deployment token ({TOKEN_ENV} or {TOKEN_FILE_ENV})",
    "--token": f"the deployment token comes from {TOKEN_ENV} or {TOKEN_FILE_ENV} (`splitserve "
               "serve` generates one per deployment)",
    "--hf-token": "a Hugging Face token comes from HF_TOKEN (read by huggingface_hub)",
}


def refusal(flag: str) -> str:
    return (f"{flag} is not taken on the command line, where every user of this machine can "
            f"read it: {SECRET_FLAGS[flag]}")


class _Refuse(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        flag = next(f for f in self.option_strings if f in SECRET_FLAGS)
        parser.error(refusal(flag))


def add_secret_guards(p: argparse.ArgumentParser) -> None:
    """Hidden flags that fail parsing with `refusal` (with or without a value)."""
    for flag in SECRET_FLAGS:
        p.add_argument(flag, nargs="?", action=_Refuse, help=argparse.SUPPRESS)


def secret_flag_of(arg: str) -> str | None:
    """The secret flag `arg` names: the flag itself or an abbreviation of it, which vLLM's
    argparse (`allow_abbrev`) would expand to that flag; None for anything else."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--") or len(flag) < 4:
        return None
    return next((secret for secret in SECRET_FLAGS if secret.startswith(flag)), None)


def check_passthrough(args: list[str] | tuple[str, ...]) -> None:
    """Raise ValueError when the arguments passed through to vLLM carry a secret flag."""
    for arg in args:
        flag = secret_flag_of(arg)
        if flag is not None:
            raise ValueError(refusal(flag) + " (also after `--`)")
