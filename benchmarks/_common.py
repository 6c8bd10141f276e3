"""Helpers shared by splitserve's benchmark scripts: streaming timing client, stats, processes."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class StreamTiming:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk
    server: dict[str, Any] = field(default_factory=dict)  # the router's timings comment

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def timed_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> StreamTiming:
    t = StreamTiming(sent=time.perf_counter())
    with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    t.chunks.append(time.perf_counter())
            elif line.startswith(": splitserve-timings "):
                t.server = json.loads(line.split(" ", 2)[2])
    return t


def random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    """Token ids of a fresh prompt (a new seed never hits any prefix cache)."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(length)]


def summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {"n": len(s), "median_ms": statistics.median(s) * 1e3,
            "mean_ms": statistics.fmean(s) * 1e3,
            "p99_ms": s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3,
            "p999_ms": s[min(len(s) - 1, int(0.999 * len(s)))] * 1e3, "max_ms": s[-1] * 1e3}


def pinned(cpus: tuple[int, ...] | None):  # type: ignore[no-untyped-def]
    def setup() -> None:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # die with the benchmark
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


def spawn(argv: list[str], log: Path, cpus: tuple[int, ...] | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=pinned(cpus), start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
