"""The package layering: shared facts live in `splitserve.common`, which imports nothing else of
splitserve; the router and the connector never import the worker's modules, and the router no
connector module either (they meet over HTTP and vLLM's plugin interface)."""

from __future__ import annotations

import ast
from pathlib import Path

import splitserve

ROOT = Path(splitserve.__file__).parent


def imports_of(package: str) -> dict[str, set[str]]:
    """Every splitserve module each file of `package` imports (lazy imports included)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[str(path.relative_to(ROOT))] = {n for n in names if n.startswith("splitserve")}
    return out


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    found = {f: {n for n in names if n.startswith(forbidden)}
             for f, names in imports_of(package).items()}
    return {f: names for f, names in found.items() if names}


def test_common_imports_nothing_else_of_splitserve() -> None:
    found = imports_of("common")
    assert {"common/load.py", "common/cpus.py", "common/engine.py"} <= set(found)
    stray = {f: {n for n in names if not n.startswith("splitserve.common")}
             for f, names in found.items()}
    assert all(not names for names in stray.values()), stray


def test_router_and_connector_do_not_import_the_worker() -> None:
    assert offenders("router", ("splitserve.worker", "splitserve.connector")) == {}
    assert offenders("connector", ("splitserve.worker",)) == {}


def test_bench_and_sim_borrow_no_worker_internals() -> None:
    internals = ("splitserve.worker.load", "splitserve.worker.cli")
    assert offenders("bench", internals) == {}
    assert offenders("sim", internals) == {}


def test_routing_policies_stand_between_the_router_and_the_simulator() -> None:
    """The shared policies import only `common`; the router and the simulator meet in them and
    never import each other."""
    found = imports_of("routing")
    stray = {f: {n for n in names if not n.startswith(("splitserve.common",
                                                       "splitserve.routing"))}
             for f, names in found.items()}
    assert found and all(not names for names in stray.values()), stray
    assert offenders("router", ("splitserve.sim",)) == {}
    assert offenders("sim", ("splitserve.router",)) == {}
