"""Test packages, checked before any worker starts:

- package-scoped fixtures end with their package only where pytest sees a package, a folder with
  `__init__.py`; without one, pytest 8+ scopes them to the session, so the workers they start
  outlive their tests and take the memory later packages' workers need;
- a test package is imported under its folder's name (`tests` itself is not a package), so that
  name must not be an installed module's: `tests/nixl` would stand in for NIXL's `nixl`."""

from __future__ import annotations

import ast
import importlib.machinery
import site
from pathlib import Path

TESTS = Path(__file__).parent


def package_scoped_fixtures(conftest: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(conftest.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and any(
                        kw.arg == "scope" and isinstance(kw.value, ast.Constant)
                        and kw.value.value == "package" for kw in deco.keywords):
                    names.append(node.name)
    return names


def test_every_package_scoped_fixture_lives_in_a_package() -> None:
    found = {c: package_scoped_fixtures(c) for c in sorted(TESTS.rglob("conftest.py"))}
    assert any(found.values()), "no package-scoped fixture found: the scan is broken"
    outside = {str(c.relative_to(TESTS)): names for c, names in found.items()
               if names and not (c.parent / "__init__.py").exists()}
    assert not outside, f"package-scoped fixtures that would live all session: {outside}"


def test_no_test_package_is_named_as_an_installed_module() -> None:
    installed = site.getsitepackages()
    assert importlib.machinery.PathFinder.find_spec("nixl", installed) is not None  # the check
    packages = sorted(p.parent.name for p in TESTS.glob("*/__init__.py"))
    assert "raybackend" in packages
    shadowing = [name for name in packages
                 if importlib.machinery.PathFinder.find_spec(name, installed) is not None]
    assert not shadowing, f"test packages named as installed modules: {shadowing}"
