"""splitserve's command line as a test's subprocess runs it."""

from __future__ import annotations

import sys

from tests.support.integration import starts_processes


@starts_processes
def splitserve_argv(*args: str) -> list[str]:
    """`splitserve ARGS...` as this interpreter runs it. A starter: every splitserve command a
    test runs as a process (a worker, a router, `serve`, `bench compare --deploy`) is built here,
    so the test is an integration test (tests/support/integration.py)."""
    return [sys.executable, "-m", "splitserve.cli", *args]
