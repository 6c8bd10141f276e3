"""A closed-loop stream generator for the Ray tests: `concurrency` clients, each sending greedy
streams of known prompts and classifying every answer against its reference.

Also the helpers these tests share: prompts, one request, a metric's value, every process's
command line.

Outcomes: `ok` (the reference tokens, then [DONE]), `wrong` (HTTP 200 and a finished stream
with other tokens), `error` (an explicit error: a non-200 answer, or an error event before
[DONE]), `cut` (the stream ended without [DONE] or an error event: a lost request).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


@dataclass
class Load:
    url: str
    model: str
    prompts: list[list[int]]
    want: list[list[int]]
    max_tokens: int
    outcomes: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    concurrency: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, concurrency: int) -> None:
        """Run `concurrency` clients (threads are only added; extra ones idle)."""
        self.concurrency = concurrency
        while len(self._threads) < concurrency:
            i = len(self._threads)
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                if i >= self.concurrency:
                    time.sleep(0.1)
                    continue
                k = (i + n) % len(self.prompts)
                n += 1
                outcome, detail = self.one(client, k)
                with self._lock:
                    self.outcomes[outcome] += 1
                    if outcome != "ok":
                        self.details.append(f"{outcome}: {detail}")

    def one(self, client: httpx.Client, k: int) -> tuple[str, str]:
        body = {"model": self.model, "prompt": self.prompts[k], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}
        tokens: list[int] = []
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return "error", f"HTTP {r.status_code} {r.read()[:200]!r}"
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        if tokens == self.want[k]:
                            return "ok", ""
                        return "wrong", f"prompt {k}: {tokens} != {self.want[k]}"
                    if line.startswith("data: "):
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            return "error", str(ev["error"])[:200]
                        for c in ev["choices"]:
                            tokens += c.get("token_ids") or []
        except httpx.HTTPError as exc:
            return "cut", f"{type(exc).__name__}: {exc}"
        return "cut", f"no [DONE] after {len(tokens)} tokens"


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 37 + i * 13) % 1000 for i in range(length)]


def complete(url: str, prompt: list[int], max_tokens: int, stream: bool,
             timeout: float = 120) -> list[int]:
    body = {"model": model_id(url), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])
    out: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    out += c.get("token_ids") or []
    return out


def metric(text: str, name: str, *labels: str) -> float:
    """The sum of a family's samples whose labels include every one of `labels`."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(label in head for label in labels):
            total += float(value)
    return total


def model_id(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def cmdlines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
            except OSError:
                continue
    return out


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def off_loopback_connections(pids: set[int]) -> list[str]:
    """`ss -tnp` lines of TCP connections of `pids` with an end off loopback."""
    import re
    import subprocess

    out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        cols = line.split()
        if not owners & pids or len(cols) < 5:
            continue
        hosts = [c.rsplit(":", 1)[0].strip("[]") for c in cols[3:5]]
        if not all(h.startswith(("127.", "::ffff:127.")) or h == "::1" for h in hosts):
            bad.append(line)
    return bad


GUARD = "splitserve.common.guard"


def processes() -> list[tuple[int, int, str]]:
    """(pid, pgid, NUL-separated command line) of every live process (a zombie holds no
    memory and is left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, pgid = f.read().rsplit(")", 1)[1].split()[:3]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if state != "Z":
            out.append((int(entry), int(pgid), cmd))
    return out


def guard_groups(marker: str) -> dict[int, list[str]]:
    """Every process group led by a guard (a Ray replica's or router's) whose command line
    holds `marker` (e.g. the test's model directory): pgid -> member cmdlines."""
    procs = processes()
    members: dict[int, list[str]] = {}
    for _, pgid, cmd in procs:
        members.setdefault(pgid, []).append(cmd)
    return {pgid: members[pgid] for pid, pgid, cmd in procs
            if pid == pgid and GUARD in cmd and marker in cmd}


def group_members(pgids: set[int]) -> list[str]:
    """Command lines of the live processes in any of `pgids`."""
    return [f"{pid}: {cmd[:120]}" for pid, pgid, cmd in processes() if pgid in pgids]
