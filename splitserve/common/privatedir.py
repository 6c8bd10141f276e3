"""A worker's private directory: where its Unix sockets live (vLLM's own between its processes,
`VLLM_RPC_BASE_PATH`, and its KV events'), made by `worker_command` and removed with the worker.

Contract: `private_dir()` makes a new directory only this user can enter, with a path short
enough for any socket name vLLM gives in it; `remove_private_dir(path)` removes only such a
directory (by its name's prefix and owner), and a directory already gone is fine, so that every
owner (the launcher, the worker's plugin, its guard) may call it. This module imports only the
standard library: the guard of every worker imports it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

WORKER_DIR_ENV = "SPLITSERVE_WORKER_DIR"  # set by worker_command: the directory it made
RUNTIME_DIR_ENV = "SPLITSERVE_RUNTIME_DIR"  # where those directories are made (optional)
DIR_PREFIX = "splitserve-worker-"
MAX_IPC_PATH = 107  # a Unix socket path has at most 107 bytes
# the longest name a socket gets in such a directory: vLLM's own are a uuid4
LONGEST_SOCKET_NAME = 36


def private_dir() -> str:
    """A new directory only this user can enter, for one worker's Unix sockets: under
    `$SPLITSERVE_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR`, else the system's temporary directory
    (whichever keeps the socket paths short enough)."""
    longest_child = len(DIR_PREFIX) + 8 + 1 + LONGEST_SOCKET_NAME  # mkdtemp adds 8 characters
    for parent in (os.environ.get(RUNTIME_DIR_ENV), os.environ.get("XDG_RUNTIME_DIR"),
                   tempfile.gettempdir(), "/tmp"):
        if parent and os.path.isdir(parent) and len(parent) + 1 + longest_child <= MAX_IPC_PATH:
            return tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent)  # mode 0700
    raise RuntimeError(f"no directory with a path short enough for Unix sockets; set "
                       f"{RUNTIME_DIR_ENV} to a short one")


def remove_private_dir(directory: str) -> None:
    """Remove a directory `private_dir` made (and nothing else); one already gone is fine."""
    path = Path(directory)
    with contextlib.suppress(FileNotFoundError):
        if path.name.startswith(DIR_PREFIX) and path.stat().st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def remove_worker_dir(env: Mapping[str, str]) -> None:
    """Remove the private directory of the worker whose environment is `env` (none made, or
    gone already: nothing to do). Its owner calls this once the worker's leader has exited,
    however it ended (`WorkerProcess` on reaping, the launcher, the guard as it takes the group
    down); the worker's plugin removes it only on a normal exit of an engine that came up."""
    directory = env.get(WORKER_DIR_ENV)
    if directory:
        remove_private_dir(directory)
