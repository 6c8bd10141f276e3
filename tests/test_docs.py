"""The documentation: the README fits on a screen, and the generated CLI reference names every
subcommand of the parsers (tools/docs_reference.py renders it when `make docs` builds the site).
No workers, no site build: `make docs` (inside `make test`) is the strict build."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.cli import build_parser
from tools.docs_reference import (
    PAGES,
    cli_markdown,
    command_names,
    config_markdown,
    iter_commands,
)

ROOT = Path(__file__).resolve().parents[1]


def _parser_commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """Every subcommand of the parsers, walked here independently of the generator."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                full = f"{prefix} {name}".strip()
                out.append(full)
                out += _parser_commands(child, full)
    return out


def test_readme_fits_on_a_screen() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_cli_reference_names_every_subcommand_and_flag() -> None:
    page = cli_markdown()
    commands = _parser_commands(build_parser())
    assert {"worker", "serve", "router", "bench", "bench compare", "sim validate",
            "plan"} <= set(commands)
    assert command_names() == commands
    for name in commands:
        assert f"## `splitserve {name}`" in page, name
    # every flag of every command, under that command's section
    sections = {s.split("`", 2)[1].removeprefix("splitserve "): s
                for s in page.split("\n## ")[1:]}
    for path, parser, _ in iter_commands():
        name = " ".join(path)
        for action in parser._actions:
            if action.help is argparse.SUPPRESS:
                continue
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in sections[name], (name, option)


def test_config_reference_names_every_yaml_key() -> None:
    from dataclasses import fields

    from splitserve.launch.config import DeploymentConfig
    from splitserve.launch.rayconfig import RayOptions

    page = config_markdown()
    for cls in (DeploymentConfig, RayOptions):
        for f in fields(cls):
            assert f"| `{f.name}` |" in page, f.name


def test_generated_pages_are_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f": {page}" in nav, page


def test_readme_links_resolve() -> None:
    import re

    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_readme_commands_parse() -> None:
    """Every `splitserve ...` line of the README's code blocks is accepted by the real parser."""
    import re
    import shlex

    text = (ROOT / "README.md").read_text()
    lines = [line.split("  #")[0].strip()
             for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines()]
    commands = [shlex.split(line)[1:] for line in lines if line.startswith("splitserve ")]
    assert len(commands) >= 2
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        assert callable(args.func), argv
