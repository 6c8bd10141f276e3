"""Chaos, test-sized: streams through 2P+2D while workers crash, are killed and come back,
transfers are corrupted, dropped, cut short and delayed, and clients hang up.

The session's P/D pair stays up; a spare P and D (crash points on) are the ones that die. Every
request must end complete and token-exact against transformers, or with an explicit error —
none lost, none a 200 with wrong tokens — and every live worker drains to zero afterwards.
(`benchmarks/chaos.py` runs the same at a larger scale.)
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.bench.chaos import ChaosRequest, Outcome, chaos_requests, run_wave, summarize
from tests.support import cores
from tests.support.routers import Router, start_router
from tests.support.workers import Worker, hf_greedy, launch, launch_together, metric_sum, stop_all

MAX_TOKENS = 24
CRASHABLE = {"SPLITSERVE_FAULTS": "1,crash"}


def spare_spec(role: str, **overrides: Any) -> tuple[str, str, dict[str, Any]]:
    """A spare worker of `role` as `launch_together` takes it: crash points on."""
    if role == "prefill":
        return "chaos-p", role, {"env": CRASHABLE, "max_num_batched_tokens": 256,
                                 "cpus": cores.spare_cores(role, 0)} | overrides
    return "chaos-d", role, {"env": CRASHABLE, "load_timeout_s": 3.0,
                             "cpus": cores.spare_cores(role, 1)} | overrides


def start_spare(ckpt: Path, role: str, **overrides: Any) -> Worker:
    name, _, kwargs = spare_spec(role, **overrides)
    return launch(ckpt, name, role, **kwargs)


@pytest.fixture(scope="module")
def spares(llama_ckpt: Path) -> Iterator[dict[str, Worker]]:
    """The spare P and D; the test replaces them when it restarts them."""
    p, d = launch_together(llama_ckpt, spare_spec("prefill"), spare_spec("decode"))
    spare = {"prefill": p, "decode": d}
    try:
        yield spare
    finally:
        stop_all(*spare.values())


def requests_for(wave: int, n: int, crashes: bool = True) -> list[ChaosRequest]:
    return chaos_requests(f"w{wave}", n, random.Random(wave), 1003, 400, crashes)


def wait_in_rotation(router: Router, urls: set[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        healthy = {w["url"] for w in router.workers() if w["healthy"]}
        if urls <= healthy:
            return
        time.sleep(0.25)
    raise AssertionError(f"workers not back in rotation: {urls - healthy}")


@pytest.mark.drain(timeout_s=30)  # as its own check waited before: crashes leave more to settle
def test_chaos(llama_pair: tuple[Worker, Worker], spares: dict[str, Worker],
               router_logs: Path, llama_ckpt: Path) -> None:
    p, d = llama_pair
    p2, d2 = spares["prefill"], spares["decode"]
    router = start_router(router_logs, "--prefill", p.url, p2.url, "--decode", d.url, d2.url,
                          "--unhealthy-after", "1", "--healthy-after", "1",
                          "--prefill-retries", "3", "--decode-retries", "3")
    outcomes: list[Outcome] = []
    prompts: dict[str, list[int]] = {}
    try:
        # Wave 1: faults by request id; the spares die during it (a crash point, else SIGKILL
        # once they hold streams) — P mid-prefill or mid-push, D mid-stream.
        wave1 = requests_for(1, 24)
        killer = threading.Thread(target=kill_when_busy, args=(router, (p2, d2)))
        killer.start()
        outcomes += run_wave(router.url, wave1, MAX_TOKENS)
        killer.join()
        assert p2.proc.poll() is not None and d2.proc.poll() is not None
        # Wave 2 on the survivors while the spares restart on their old ports.
        restarted: dict[str, Worker] = {}
        restart = threading.Thread(target=lambda: restarted.update(
            prefill=start_spare(llama_ckpt, "prefill", port=p2.cfg.port, kv_port=p2.cfg.kv_port),
            decode=start_spare(llama_ckpt, "decode", port=d2.cfg.port, kv_port=d2.cfg.kv_port)))
        restart.start()
        wave2 = requests_for(2, 8)
        outcomes += run_wave(router.url, wave2, MAX_TOKENS)
        restart.join()
        spares.update(restarted)
        # Wave 3: everyone is back, and the restarted workers take work again.
        wait_in_rotation(router, {p2.url, d2.url})
        wave3 = requests_for(3, 16, crashes=False)
        outcomes += run_wave(router.url, wave3, MAX_TOKENS)
        for r in (*wave1, *wave2, *wave3):
            prompts[r.rid] = r.prompt
    finally:
        router.stop()
    references = {rid: hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
                  for rid, prompt in prompts.items()}
    summary = summarize(outcomes, references)
    print({k: summary[k] for k in ("sent", "complete", "error", "cancelled", "wrong", "lost")})
    assert summary["wrong"] == 0 and summary["lost"] == 0, summary["bad"]
    finished = summary["complete"] + summary["error"]
    assert summary["complete"] >= 0.8 * finished, summary["errors"]
    assert summary["cancelled"] > 0
    live = (p, d, spares["prefill"], spares["decode"])
    for w in live:
        assert w.proc.poll() is None
    assert_served(spares["prefill"]) and assert_served(spares["decode"])


def kill_when_busy(router: Router, victims: tuple[Worker, ...], timeout_s: float = 60.0) -> None:
    """SIGKILL each victim once the router has legs open on it (unless a crash point already
    took it down)."""
    pending = list(victims)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        load = {w["url"]: w["inflight"] for w in router.workers()}
        for w in list(pending):
            if w.proc.poll() is not None:
                pending.remove(w)
            elif load.get(w.url, 0) > 0:
                if w.cfg.role == "decode":
                    time.sleep(0.3)  # let its streams get going; a P leg is killed at once
                w.kill()
                pending.remove(w)
        time.sleep(0.05)
    for w in pending:
        w.kill()


def assert_served(worker: Worker) -> bool:
    """The worker completed requests since it (re)started."""
    total = metric_sum(worker, "vllm:request_success_total")
    assert total > 0, f"{worker.url} took no requests after its restart"
    return True
