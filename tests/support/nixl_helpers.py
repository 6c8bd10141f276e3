"""Driving vLLM's NixlConnector's two legs by hand, and reading what each worker computed."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.workers import Worker, auth_headers, model_name

# P's KV lease in the NIXL fixture: short, so abandoned blocks come back within CI time
NIXL_LEASE_S = 12.0


def prefill_leg(p: Worker, prompt: list[int], path: str = "/v1/completions",
                messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """P's leg: one token, and P keeps the blocks for D's pull (`do_remote_decode`)."""
    body: dict[str, Any] = {"model": model_name(p), "max_tokens": 1, "temperature": 0,
                            "return_token_ids": True,
                            "kv_transfer_params": {"do_remote_decode": True}}
    body |= {"messages": messages} if messages is not None else {"prompt": prompt}
    r = httpx.post(f"{p.url}{path}", json=body, headers=auth_headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def decode_leg(d: Worker, prompt: list[int], params: dict[str, Any], max_tokens: int
               ) -> httpx.Response:
    """D's leg: `prompt` with the `kv_transfer_params` of P's answer (D pulls P's blocks)."""
    body = {"model": model_name(d), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "kv_transfer_params": params}
    return httpx.post(f"{d.url}/v1/completions", json=body, headers=auth_headers(), timeout=120)


def two_legs(p: Worker, d: Worker, prompt: list[int], max_tokens: int) -> list[int]:
    """The split request as splitserve's router sends it over NIXL: P's t1, then D on the
    prompt alone (D loads every block P computed, recomputes the last prompt token and emits t1
    again, which must repeat P's)."""
    answer = prefill_leg(p, prompt)
    t1 = answer["choices"][0]["token_ids"][0]
    if max_tokens == 1:
        return [t1]
    r = decode_leg(d, prompt, answer["kv_transfer_params"], max_tokens)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["token_ids"]
    assert tokens[0] == t1, (t1, tokens)
    return tokens


def by_label(w: Worker, family: str, label: str, values: tuple[str, ...]) -> dict[str, float]:
    """The samples of one Prometheus counter `family` on the worker's /metrics, summed by the
    value of `label` (each of `values`; 0 when absent)."""
    text = httpx.get(f"{w.url}/metrics", headers=auth_headers(), timeout=5).text
    out = dict.fromkeys(values, 0.0)
    for line in text.splitlines():
        if line.startswith(family + "{"):
            for value in out:
                if f'{label}="{value}"' in line:
                    out[value] += float(line.rsplit(" ", 1)[1])
    return out


def tokens_by_source(w: Worker) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source` (computed, prefix-cache hits, loaded by the connector):
    vLLM's `request_prefill_kv_computed_tokens` counts loaded tokens as computed."""
    return by_label(w, "vllm:prompt_tokens_by_source_total", "source",
                    ("local_compute", "local_cache_hit", "external_kv_transfer"))


def finished_by_reason(w: Worker) -> dict[str, float]:
    """`vllm:request_success_total` by `finished_reason` (an aborted request counts as abort)."""
    return by_label(w, "vllm:request_success_total", "finished_reason",
                    ("stop", "length", "abort", "error"))


def stream_tokens(url: str, path: str, body: dict[str, Any],
                  on_tokens: Callable[[int], None] | None = None
                  ) -> tuple[list[int], dict[str, Any]]:
    """A streamed request's token ids and the router's timings comment; the stream must end
    with no error event. `on_tokens(n)` runs after each event that brings tokens, with how many
    the client has so far (a test's moment to fail a worker)."""
    tokens: list[int] = []
    timings: dict[str, Any] = {}
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                new = [t for c in ev["choices"] for t in c.get("token_ids") or []]
                tokens += new
                if new and on_tokens is not None:
                    on_tokens(len(tokens))
            elif line.startswith(": splitserve-timings "):
                timings = json.loads(line.split(" ", 2)[2])
    return tokens, timings


def group_cpu_seconds(w: Worker) -> float:
    """CPU seconds (user + system) used so far by every process of the worker's group."""
    pgid = w.proc.pid
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(workers: list[Worker], seconds: float) -> list[float]:
    """Each worker's CPU use over `seconds` of wall time, in cores."""
    before = [group_cpu_seconds(w) for w in workers]
    start = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    return [(group_cpu_seconds(w) - b) / wall for w, b in zip(workers, before, strict=True)]


def wait_kv_free(*workers: Worker, timeout_s: float) -> float:
    """Seconds until every worker's `vllm:kv_cache_usage_perc` reads zero; fails past timeout."""
    start = time.monotonic()
    usage: list[float] = []
    while time.monotonic() - start < timeout_s:
        usage = [w.kv_usage() for w in workers]
        if all(u == 0.0 for u in usage):
            return time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"KV still in use after {timeout_s} s: {usage}")
