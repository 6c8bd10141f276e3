"""The simulator's imports go one way: no import cycle among `splitserve.sim`'s modules (every
import counts: at module level, inside functions, under TYPE_CHECKING), the engine imports
nothing from the calibration (its caller composes the overlay), and the cost model nothing
else from `sim`. And no function in the package is over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import splitserve

ROOT = Path(splitserve.__file__).parent
ENGINE = ("simulator", "stepping", "workerstate", "handoff", "overlay", "routing", "deployment",
          "model")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(
        ".__init__")


def sim_imports() -> dict[str, set[str]]:
    """Each module of `splitserve.sim` → the modules of `splitserve.sim` it imports."""
    paths = {_module(p): p for p in (ROOT / "sim").rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        out[name] = {m for m in found if m in paths and m != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles, as its strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = [stack.pop()]
            while comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_sim_has_no_import_cycle() -> None:
    graph = sim_imports()
    assert "splitserve.sim.simulator" in graph and len(graph) > 20
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_does_not_choose_its_calibration() -> None:
    graph = sim_imports()
    for mod in ENGINE:
        calib = {m for m in graph[f"splitserve.sim.{mod}"] if ".calibration." in m}
        assert calib <= {"splitserve.sim.calibration.costs"}, (mod, calib)
    assert graph["splitserve.sim.costmodel"] == set()


def test_no_function_is_over_80_lines() -> None:
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                assert node.end_lineno is not None
                if node.end_lineno - start + 1 > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []
