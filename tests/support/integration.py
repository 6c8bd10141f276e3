"""What makes a test an integration test, and the checks that come with being one.

The rule (applied by tests/conftest.py at collection; nothing to remember when writing a test):
a test is an `integration` test when its function, or any fixture it uses (directly, through
other fixtures, or by name through `request.getfixturevalue("...")`), can reach a *starter*: a
helper that starts real server processes. Reaching means naming it, or naming a function or
class defined under tests/ that reaches it (followed through any depth; names imported inside
a function count too). The starters are the
helpers marked `@starts_processes` (`support.workers.launch`, `launch_together`,
`support.routers.start_router`, `support.cli.splitserve_argv`, the Ray cluster fixture) and
`STARTERS` (splitserve's own `start_worker`). A test may also carry `@pytest.mark.integration`
itself.

Two checks keep the rule honest:
- A test that is not marked runs with `no_server_processes`: starting a vLLM server, a
  splitserve worker/router/deployment or a Ray node from it fails the test (so `make test-fast`
  can never start one unnoticed; the fix is to start it through a starter).
- After an integration test's body passes, every worker `launch` started and nobody stopped
  must drain (`check_drained`); `@pytest.mark.drain(timeout_s=...)` gives it longer.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from splitserve.worker.launch import start_worker

F = TypeVar("F", bound=Callable[..., Any])
TESTS = Path(__file__).resolve().parents[1]
# splitserve's own functions that start a server process (tests may call them directly)
STARTERS: tuple[Callable[..., Any], ...] = (start_worker,)
DRAIN_TIMEOUT_S = 15.0


def starts_processes(fn: F) -> F:
    """Mark a helper or fixture function as a starter: every test reaching it is an integration
    test. Put it under `@pytest.fixture` on a fixture."""
    fn.__starts_processes__ = True  # type: ignore[attr-defined]
    return fn


def _is_starter(obj: object) -> bool:
    return getattr(obj, "__starts_processes__", False) or any(obj is s for s in STARTERS)


def _in_tests(obj: object) -> bool:
    code = getattr(obj, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS)


def _names(code: types.CodeType) -> Iterator[str]:
    """Every global name and string constant in `code` and the code nested in it."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, types.CodeType):
            yield from _names(const)


def reaches_starter(fn: object, fixture: Callable[[str], list[Any]],
                    seen: set[int] | None = None) -> bool:
    """`fn` is a starter or reaches one (see the module's rule). `fixture(name)` gives the
    functions of the fixtures `name` may be (none when no fixture has that name)."""
    seen = set() if seen is None else seen
    fn = inspect.unwrap(fn) if callable(fn) else fn  # type: ignore[arg-type]
    if _is_starter(fn):
        return True
    if id(fn) in seen:
        return False
    seen.add(id(fn))
    if inspect.isclass(fn):
        return any(reaches_starter(v, fixture, seen) for v in vars(fn).values()
                   if _in_tests(inspect.unwrap(v) if callable(v) else v))
    if not _in_tests(fn):
        return False
    names = list(_names(fn.__code__))  # type: ignore[attr-defined]
    globals_ = getattr(fn, "__globals__", {})
    # the function's globals, and the modules it names (`mod.helper`, or a local import)
    modules = [m for m in (globals_.get(n, sys.modules.get(n)) for n in names)
               if isinstance(m, types.ModuleType)]
    scopes = [globals_, *(vars(m) for m in modules)]
    for name in names:
        for obj in (scope[name] for scope in scopes if name in scope):
            if _is_starter(obj) or ((inspect.isfunction(obj) or inspect.isclass(obj))
                                    and reaches_starter(obj, fixture, seen)):
                return True
        if any(reaches_starter(f, fixture, seen) for f in fixture(name)):
            return True
    return False


def is_integration(item: pytest.Item) -> bool:
    """The module's rule for one collected test."""
    if item.get_closest_marker("integration") is not None:
        return True
    info = getattr(item, "_fixtureinfo", None)
    manager = item.session._fixturemanager

    def fixture(name: str) -> list[Any]:
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs is None and name.isidentifier():
            defs = manager.getfixturedefs(name, item)
        return [d.func for d in defs or ()]

    functions = [getattr(item, "function", None)]
    functions += [f for name in getattr(item, "fixturenames", ()) for f in fixture(name)]
    seen: set[int] = set()
    return any(f is not None and reaches_starter(f, fixture, seen) for f in functions)


def server_command(argv: list[str]) -> str | None:
    """What server `argv` starts (None: not a server this module guards against)."""
    words = [os.fspath(a) if not isinstance(a, bytes) else a.decode() for a in argv]
    if any("vllm.entrypoints" in w for w in words) or Path(words[0]).name == "vllm":
        return "a vLLM server"
    if any(Path(w).name in ("raylet", "gcs_server") for w in words):
        return "a Ray node"
    if "splitserve.cli" in words or Path(words[0]).name == "splitserve":
        at = words.index("splitserve.cli") + 1 if "splitserve.cli" in words else 1
        command = words[at] if at < len(words) else ""
        if command in ("worker", "router", "serve") or (command == "bench"
                                                         and "--deploy" in words):
            return f"`splitserve {command}`"
    return None


@contextlib.contextmanager
def no_server_processes(nodeid: str) -> Iterator[None]:
    """Within the block, a `subprocess.Popen` of a server (`server_command`) fails the test."""
    original = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], *args: Any, **kw: Any) -> None:
        command = kw["args"] if "args" in kw else args[0]
        argv = [command] if isinstance(command, str | bytes | os.PathLike) else list(command)
        what = server_command(argv)
        if what is not None:
            pytest.fail(f"{nodeid} starts {what} but is not an integration test: start it "
                        "through a tests.support starter (see tests/support/integration.py)",
                        pytrace=False)
        original(self, *args, **kw)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]


def check_drained(item: pytest.Item) -> None:
    """Every live worker (started by `launch`, not stopped or killed) drains to zero within
    the test's `drain` marker's `timeout_s` (default `DRAIN_TIMEOUT_S`); raises if not."""
    from tests.support.workers import LIVE, wait_drained

    marker = item.get_closest_marker("drain")
    timeout_s = marker.kwargs.get("timeout_s", DRAIN_TIMEOUT_S) if marker else DRAIN_TIMEOUT_S
    workers = sorted((w for w in LIVE if w.proc.poll() is None), key=lambda w: w.url)
    if workers:
        wait_drained(*workers, timeout_s=timeout_s)
