"""The documentation site's generated reference pages, rendered from the code at build time.

`PAGES` maps a page of the site (a path under docs/, never written there) to the function that
renders it:

- `reference/cli.md`: every `splitserve` subcommand, from the argparse parsers that
  `splitserve.cli.build_parser()` builds (flags, defaults, choices, help);
- `reference/config.md`: the deployment YAML, from `DeploymentConfig` and `RayOptions`
  (field, type, default, the comment beside the field in the source);
- `reference/metrics.md`: the Prometheus families splitserve exports, read from the
  collectors themselves (the router's registry, the worker's connector and relay collectors).

`tools/mkdocs_hooks.py` adds these pages to the build, so a flag or field added to the code
appears in the site without anyone editing a page; `tests/test_docs.py` checks the CLI page.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

# --------------------------------------------------------------------------- the CLI


def _cell(text: object) -> str:
    """Text safe inside a markdown table cell."""
    s = " ".join(str(text).split())
    return s.replace("|", "\\|")


def _code(text: object) -> str:
    s = str(text)
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def iter_commands(parser: argparse.ArgumentParser | None = None, prefix: tuple[str, ...] = ()
                  ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command below `parser` (default: `splitserve`'s), depth first, as
    (path of names, its parser, the one-line help it was registered with)."""
    if parser is None:
        from splitserve.cli import build_parser

        parser = build_parser()
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, child in sub.choices.items():
        path = prefix + (name,)
        yield path, child, helps.get(name, "")
        yield from iter_commands(child, path)


def command_names() -> list[str]:
    """Every subcommand as typed: `worker`, `bench compare`, ..."""
    return [" ".join(path) for path, _, _ in iter_commands()]


def _flag_row(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(_code(s) for s in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            if isinstance(metavar, tuple):
                metavar = " ".join(metavar)
            if action.nargs in ("+", "*"):
                metavar = f"{metavar} …"
            names += f" {_code(metavar)}"
    else:
        names = _code(action.metavar or action.dest)
    default = action.default
    if action.nargs == 0 or default is None or default is argparse.SUPPRESS or default == []:
        shown = ""
    else:
        shown = _code(default if not isinstance(default, tuple | list)
                      else ",".join(map(str, default)))
    help_text = action.help or ""
    if help_text is argparse.SUPPRESS:
        help_text = ""
    if "%(" in help_text:
        try:
            help_text = help_text % {**vars(action), "prog": ""}
        except (KeyError, TypeError, ValueError):
            pass
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        choices = ", ".join(_code(c) for c in action.choices)
        help_text = f"{help_text} (one of {choices})" if help_text else f"one of {choices}"
    if action.required and action.option_strings:
        help_text = f"**required.** {help_text}"
    return f"| {names} | {shown} | {_cell(help_text)} |"


def cli_markdown() -> str:
    """The CLI reference page: one section per subcommand, one table row per flag."""
    from splitserve.cli import COMMAND_MODULES

    out = [
        "# CLI reference",
        "",
        "<!-- generated at build time by tools/docs_reference.py from splitserve.cli's "
        "parsers; do not edit -->",
        "",
        "Generated from the argument parsers when the site is built "
        "(`tools/docs_reference.py`), so it matches `splitserve COMMAND --help` of this "
        f"checkout. The parsers are registered by {', '.join(_code(m) for m in COMMAND_MODULES)}. "
        "Everything after a lone `--` is passed through unchanged (to vLLM, for `worker` and "
        "`serve`).",
        "",
    ]
    commands = list(iter_commands())
    out.append("| command | what it does |")
    out.append("|---|---|")
    for path, _, help_text in commands:
        name = " ".join(path)
        anchor = "splitserve-" + "-".join(path)
        out.append(f"| [`splitserve {name}`](#{anchor}) | {_cell(help_text)} |")
    out.append("")
    for path, parser, help_text in commands:
        name = " ".join(path)
        anchor = "splitserve-" + "-".join(path)
        out.append(f"## `splitserve {name}` {{#{anchor}}}")
        out.append("")
        description = parser.description or help_text
        if description:
            out.append(textwrap.dedent(description).strip())
            out.append("")
        usage = parser.format_usage().strip()
        usage = re.sub(r"^usage:\s*", "", usage)
        out.append("```text")
        out.append(usage)
        out.append("```")
        out.append("")
        rows = [a for a in parser._actions
                if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
                and a.help is not argparse.SUPPRESS]
        sub = _subparsers(parser)
        if sub is not None:
            subs = ", ".join(f"[`{s}`](#splitserve-{'-'.join(path + (s,))})"
                             for s in sub.choices)
            out.append(f"Subcommands: {subs}.")
            out.append("")
        if rows:
            out.append("| flag | default | meaning |")
            out.append("|---|---|---|")
            out.extend(_flag_row(a) for a in rows)
            out.append("")
        if parser.epilog:
            out.append(textwrap.dedent(parser.epilog).strip())
            out.append("")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the YAML


def _field_comments(cls: type) -> dict[str, str]:
    """The comment beside each field of a dataclass (or on the lines just above it)."""
    lines = inspect.getsource(cls).splitlines()
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    comments: dict[str, str] = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        line = lines[node.lineno - 1]
        above = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        beside = line.split("#", 1)[1].strip() if "#" in line else ""
        comments[node.target.id] = " ".join(p for p in (*above, beside) if p)
    return comments


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(below)"
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return _code("true" if value else "false")
    if isinstance(value, tuple):
        return _code("[]") if not value else _code(list(value))
    return _code(value)


def _type(f: dataclasses.Field[Any]) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return _cell(t.replace("Resources", "mapping of resource: amount"))


def _serve_flags() -> dict[str, tuple[str, str]]:
    """`splitserve serve`'s flags by the field they set: {dest: (option, help)}."""
    for path, parser, _ in iter_commands():
        if path == ("serve",):
            out = {}
            for a in parser._actions:
                if a.option_strings and a.help is not argparse.SUPPRESS:
                    out[a.dest] = (a.option_strings[-1], " ".join((a.help or "").split()))
            aliases = {"kv_lease": "kv_lease_s", "kv_events": "kv_events"}
            for dest, field_name in aliases.items():
                if dest in out and field_name not in out:
                    out[field_name] = out[dest]
            return out
    return {}


def _docstring_comments(doc: str) -> dict[str, str]:
    """`key: value  # comment` lines of an example in a docstring: {key: comment}."""
    out = {}
    for line in doc.splitlines():
        m = re.match(r"\s*(\w+):[^#]*#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def config_markdown() -> str:
    """The deployment YAML's keys, from `DeploymentConfig` and `RayOptions`."""
    from splitserve.launch import config as deploy
    from splitserve.launch import rayconfig
    from splitserve.launch.rayconfig import RayOptions

    out = [
        "# Deployment YAML",
        "",
        "<!-- generated at build time by tools/docs_reference.py; do not edit -->",
        "",
        "`splitserve serve --config FILE` reads a mapping whose keys are the fields of "
        "`splitserve.launch.config.DeploymentConfig`; this page is generated from that class "
        "when the site is built (types, defaults and the comments beside each field). Flags "
        "given to `serve` win over the file. Unknown keys are refused. The keys "
        f"{', '.join(_code(k) for k in deploy.ROUTER_KEYS)} may also be written under a "
        "`router:` mapping.",
        "",
        "The example in the module's docstring:",
        "",
        "```yaml",
        textwrap.dedent((deploy.__doc__ or "").split("Example:", 1)[-1]).strip("\n"),
        "```",
        "",
        "A Ray deployment: [ray-2p4d.yaml](../ray-2p4d.yaml) "
        "([Ray guide](../ray.md)).",
        "",
        "## Top-level keys",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    comments = _field_comments(deploy.DeploymentConfig)
    flags = _serve_flags()
    for f in dataclasses.fields(deploy.DeploymentConfig):
        meaning = comments.get(f.name, "")
        flag = flags.get(f.name)
        if flag is not None:
            option, help_text = flag
            meaning = meaning or help_text
            meaning = f"{meaning}; flag: `serve {option}`" if meaning else f"`serve {option}`"
        if f.name in deploy.ROUTER_KEYS:
            meaning = f"{meaning} (also under `router:`)".strip()
        if f.name == "ray":
            meaning = "Ray placement and scaling: the keys below"
        out.append(f"| `{f.name}` | {_type(f)} | {_default(f)} | {_cell(meaning)} |")
    out += [
        "",
        "## `ray:` keys",
        "",
        _cell(textwrap.dedent(RayOptions.__doc__ or "").strip()),
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    comments = _field_comments(RayOptions)
    comments.update({k: v for k, v in _docstring_comments(rayconfig.__doc__ or "").items()
                     if not comments.get(k)})
    for f in dataclasses.fields(RayOptions):
        meaning = _cell(comments.get(f.name, "")) or "see the [Ray guide](../ray.md)"
        out.append(f"| `{f.name}` | {_type(f)} | {_default(f)} | {meaning} |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the metrics


def _family_rows(metrics: Any) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name, type, labels, help) of families yielded by `collect()` (client objects or
    `*MetricFamily`s)."""
    rows = []
    for m in metrics:
        name = m.name
        kind = m.type
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"
        labels = tuple(getattr(m, "_labelnames", ()) or ())
        if not labels:
            labels = tuple(sorted({k for s in m.samples for k in s.labels if k != "le"}))
        rows.append((name, kind, labels, m.documentation))
    return rows


def router_families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """The router's families: its registry, with the per-worker collectors watching nothing."""
    from prometheus_client.metrics import MetricWrapperBase

    from splitserve.router.metrics import CacheCollector, RouterMetrics, WorkerCollector

    m = RouterMetrics()
    rows = []
    for value in vars(m).values():
        if isinstance(value, MetricWrapperBase):
            name = value._name + ("_total" if value._type == "counter" else "")
            rows.append((name, value._type, tuple(value._labelnames), value._documentation))
    rows += _family_rows(WorkerCollector(lambda: []).collect())
    rows += _family_rows(CacheCollector(lambda: [], lambda url: None, lambda: (0, 0)).collect())
    return rows


def worker_families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """A worker's splitserve families: the connector's collector over a stand-in state, and
    the cache report's relay collector over a stand-in relay (no engine, no sockets)."""
    from splitserve.worker import kvrelay, rank_listeners

    transfers = SimpleNamespace(counts={"send_ok": 0}, failures={"none": 0},
                                bytes_total={"send": 0}, seconds_total={"send": 0.0})
    state = SimpleNamespace(transfers=transfers, **{k: 0 for k in rank_listeners.GAUGES})
    listeners = SimpleNamespace(state=lambda timeout_s: state)  # the ranks' summed state
    collector = rank_listeners.ConnectorCollector(listeners)  # type: ignore[arg-type]
    rows = _family_rows(collector.collect())
    blocks = type("Blocks", (), {"__len__": lambda self: 0, "entries": 0, "exact": True,
                                 "changes_total": 0, "epochs_lost": 0})()
    relay = SimpleNamespace(lock=threading.Lock(), blocks=blocks, batches=0, replayed=0, gaps=0)
    rows += _family_rows(kvrelay.RelayCollector(relay).collect())  # type: ignore[arg-type]
    return rows


def _metrics_table(rows: list[tuple[str, str, tuple[str, ...], str]]) -> list[str]:
    out = ["| family | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, doc in rows:
        shown = ", ".join(_code(x) for x in labels) or "–"
        if kind == "histogram":
            name_cell = f"`{name}_bucket`, `_sum`, `_count`"
            shown = ", ".join(_code(x) for x in (*labels, "le"))
        else:
            name_cell = f"`{name}`"
        out.append(f"| {name_cell} | {kind} | {shown} | {_cell(doc)} |")
    return out


def metrics_markdown() -> str:
    out = [
        "# Prometheus metrics",
        "",
        "<!-- generated at build time by tools/docs_reference.py; do not edit -->",
        "",
        "Every family splitserve adds, generated when the site is built by asking the "
        "collectors themselves what they export (`splitserve/router/metrics.py`, "
        "`splitserve/worker/plugin.py`, `splitserve/worker/kvrelay.py`): the names, types, "
        "labels and help strings below are the ones a scrape returns. Histograms use the "
        "router's buckets (latency 1 ms to 60 s; bytes 1 KiB to 4 GiB; GB/s 0.01 to 32). "
        "How to read them, and what an operator watches: [Metrics](../operations/metrics.md).",
        "",
        "## The router (`GET /metrics` on the router, no authentication)",
        "",
        "The per-worker families carry the labels `role` (`prefill`, `decode`, `colocated`), "
        "`url` and `node` (the Ray node id where the launcher named one, else empty).",
        "",
        *_metrics_table(router_families()),
        "",
        "## A worker (`GET /metrics` on each worker, deployment token required)",
        "",
        "Beside vLLM's own families (`vllm:*`: vLLM's documentation lists them; "
        "`vllm:prompt_tokens_by_source{source=\"external_kv_transfer\"}` counts KV loaded "
        "from another worker), a P or D worker with splitserve's connector adds the "
        "connector's families (`splitserve_kv_listener_up` is 0, and the rest absent, while "
        "the connector does not answer), and every worker that reports its prefix cache adds "
        "the relay's (`splitserve_kv_events_*`). The label `side` is `send` (P's side of a "
        "transfer) or `recv` (D's); `status` a transfer status; `cause` a failure cause.",
        "",
        *_metrics_table(worker_families()),
        "",
    ]
    return "\n".join(out) + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_markdown,
    "reference/config.md": config_markdown,
    "reference/metrics.md": metrics_markdown,
}


if __name__ == "__main__":  # print one page: python tools/docs_reference.py reference/cli.md
    import sys

    for page in sys.argv[1:] or list(PAGES):
        print(PAGES[page]())
