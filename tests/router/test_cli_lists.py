"""A list flag given twice adds to the list (argparse's plain `nargs` keeps only the last one):
`splitserve router --prefill A --prefill B` routes to A and B. Through the real parsers, every
list-valued flag of every command (a check that finds a new one that would drop values)."""

from __future__ import annotations

import argparse

from splitserve.cli import build_parser
from splitserve.router.cli import config_from_args

A, B, C = "http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8102"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_repeated_pool_flags_add_workers() -> None:
    args = parse("router", "--prefill", A, "--prefill", B, "--decode", A, B, "--decode", C,
                 "--colocated", C, "--colocated", A, "--peer", A, "--peer", B)
    cfg = config_from_args(args)
    assert cfg.prefill == (A, B)
    assert cfg.decode == (A, B, C)
    assert cfg.colocated == (C, A)
    assert cfg.peers == (A, B)
    again = config_from_args(parse("router", "--colocated", B))  # defaults are not shared
    assert again.prefill == again.decode == again.peers == () and again.colocated == (B,)


def test_sim_validate_rates_add_up() -> None:
    args = parse("sim", "validate", "--profile", "p.json", "--rates", "0.5,1", "--rates", "2")
    assert list(args.rates) == [0.5, 1.0, 2.0]
    assert parse("sim", "validate", "--profile", "p.json").rates is None


def list_flags(parser: argparse.ArgumentParser, path: str = "splitserve"
               ) -> list[tuple[str, argparse.Action]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += list_flags(sub, f"{path} {name}")
        elif action.option_strings:
            out.append((path, action))
    return out


def test_sweep_rates_add_up_wherever_they_are_taken() -> None:
    for cmd in (("bench", "--url", A), ("sim", "--profile", "p.json")):
        args = parse(*cmd, "--sweep-rates", "1,2", "--sweep-rates", "4")
        assert list(args.sweep_rates) == [1.0, 2.0, 4.0], cmd
        assert list(parse(*cmd).sweep_rates) == []


def test_no_flag_of_several_values_keeps_only_the_last() -> None:
    """A flag taking several values (`nargs` + or *) must extend or append."""
    wrong = [f"{path} {a.option_strings[0]}" for path, a in list_flags(build_parser())
             if a.nargs in ("+", "*")
             and not isinstance(a, argparse._AppendAction | argparse._ExtendAction)]
    assert wrong == []
