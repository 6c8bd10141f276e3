"""A 1P+1D deployment for the benchmark: a prefill and a decode worker, one core each, behind
splitserve's router. Yields the router's URL and stops every process on exit.

The workers are started with `splitserve.worker.launch` (roles `prefill` and `decode`, the shm
transport, one deployment token in the environment); the router with `splitserve router`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from splitserve.config import TOKEN_ENV, WorkerConfig, new_token
from splitserve.worker.launch import free_port, start_worker, wait_healthy


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_router(prefill: str, decode: str, port: int, token: str,
                 log_path: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--prefill", prefill,
            "--decode", decode, "--port", str(port)]
    env = dict(os.environ) | {TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    out = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


@contextlib.contextmanager
def disagg_deployment(model: str, cores: tuple[int, ...], served_name: str,
                      log_dir: Path, transport: str = "shm") -> Iterator[str]:
    """1P+1D on `cores` (P on the first half, D on the rest); yields the router URL."""
    if len(cores) < 2:
        raise RuntimeError("1P+1D needs at least two cores")
    half = len(cores) // 2
    token = new_token()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cfgs = []
        for role, cpus in (("prefill", cores[:half]), ("decode", cores[half:])):
            cfg = WorkerConfig(model=model, port=free_port(), role=role, cpus=tuple(cpus),
                               kv_port=free_port(), transport=transport,  # type: ignore[arg-type]
                               served_model_name=served_name)
            procs.append(start_worker(cfg, token, str(log_dir / f"disagg-{role}.log")))
            cfgs.append(cfg)
        for cfg, proc in zip(cfgs, procs, strict=True):
            wait_healthy(cfg.url, proc, timeout_s=240)
        port = free_port()
        procs.append(start_router(cfgs[0].url, cfgs[1].url, port, token,
                                  log_dir / "disagg-router.log"))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs[-1], timeout_s=60)
        yield url
    finally:
        for proc in reversed(procs):
            stop_process(proc)
