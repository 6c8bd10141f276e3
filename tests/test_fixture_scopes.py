"""Package-scoped fixtures end with their package only where pytest sees a package: a folder
with `__init__.py`. Without one, pytest 8+ scopes them to the session, so the workers they start
outlive their tests and take the memory later packages' workers need."""

from __future__ import annotations

import ast
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
