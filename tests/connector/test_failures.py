"""Transfer failures end as a recompute (default) or an explicit error (`fail`), never as tokens
from wrong memory; nothing stays allocated on either worker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.common.load import parse_metrics as parse_gauges
from splitserve.common.wire import WorkerLoad
from tests.support import cores
from tests.support.workers import (
    Worker,
    auth_headers,
    hf_greedy,
    launch_together,
    model_name,
    stop_all,
    transfer_record,
    two_legs,
    wait_drained,
)

MAX_TOKENS = 10
PROMPT = [5 + (i * 13) % 900 for i in range(300)]


@pytest.fixture(scope="module")
def spare_ds(llama_ckpt: Path) -> Iterator[tuple[Worker, Worker]]:
    """This module's two decode workers, started side by side: one whose transfer failures
    fail the request instead of recomputing, and one with 1 MiB of staging."""
    fail, tiny = launch_together(
        llama_ckpt,
        ("llama-d-fail", "decode", {"on_transfer_failure": "fail", "load_timeout_s": 3.0,
                                    "cpus": cores.spare_cores("decode")}),
        # on P's core when there is no spare one: the two start side by side, a core each
        ("llama-d-tiny", "decode", {"staging_bytes": 1024**2, "load_timeout_s": 3.0,
                                    "cpus": cores.spare_cores("prefill", 1)}))
    yield fail, tiny
    stop_all(fail, tiny)


@pytest.fixture
def d_fail(spare_ds: tuple[Worker, Worker]) -> Worker:
    return spare_ds[0]


def fresh(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex}"


@pytest.mark.parametrize("fault", ["fault-corrupt", "fault-drop", "fault-short"])
def test_bad_transfer_is_recomputed_exactly(llama_pair: tuple[Worker, Worker],
                                            llama_ckpt: Path, fault: str) -> None:
    p, d = llama_pair
    prompt = PROMPT[:-1] + [len(fault)]  # distinct from other tests' prompts: no cache hits
    tid = fresh(fault)
    tokens, _, rd = two_legs(p, d, prompt, MAX_TOKENS, tid)
    assert rd is not None and rd.status_code == 200
    assert tokens == hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
    rec = transfer_record(d, tid) if fault != "fault-drop" else None
    if rec is not None:
        assert rec["recv"]["status"] == "failed", rec
        expected = {"fault-corrupt": "checksum_mismatch", "fault-short": "short_transfer"}
        assert rec["recv"]["cause"] == expected[fault]


def test_complete_transfer_loads_in_the_same_step_late_one_waits(
        llama_pair: tuple[Worker, Worker], llama_ckpt: Path) -> None:
    """A transfer already verified when the decode request is scheduled is loaded synchronously
    (before that step's forward); one still arriving is waited for asynchronously."""
    p, d = llama_pair
    for tag, mode in (("on-time", "sync"), ("fault-delay", "async")):
        prompt = PROMPT[:260] + [len(tag)]
        tid = fresh(tag)
        if mode == "sync":  # let the push finish (P holds its blocks until D's ACK) first
            name = model_name(p)
            body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "return_token_ids": True,
                    "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid,
                                           "remote_host": "127.0.0.1", "remote_port": d.kv_port}}
            rp = httpx.post(f"{p.url}/v1/completions", json=body, headers=auth_headers(),
                            timeout=60)
            t1 = rp.json()["choices"][0]["token_ids"][0]
            wait_drained(p)  # acknowledged: the transfer is complete on D
            body = {"model": name, "prompt": prompt + [t1], "max_tokens": MAX_TOKENS - 1,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                    "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid}}
            rd = httpx.post(f"{d.url}/v1/completions", json=body, headers=auth_headers(),
                            timeout=60)
            tokens = [t1] + rd.json()["choices"][0]["token_ids"]
        else:
            tokens, _, rd = two_legs(p, d, prompt, MAX_TOKENS, tid)
        assert rd is not None and rd.status_code == 200
        assert tokens == hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
        rec = transfer_record(d, tid)["recv"]
        assert rec["status"] == "loaded" and rec["load_mode"] == mode, rec
        # sync: scheduled after the test saw the push acknowledged; async: before it completed
        assert rec["started_s"] <= rec["scheduled_s"] <= time.time(), rec
        assert (rec["scheduled_s"] >= rec["complete_s"]) == (mode == "sync"), rec


def test_unknown_transfer_id_is_a_load_error(llama_pair: tuple[Worker, Worker],
                                             llama_ckpt: Path) -> None:
    p, d = llama_pair
    prompt = PROMPT[:200]
    t1 = hf_greedy(llama_ckpt, prompt, 1)[0]
    body = {"model": model_name(d), "prompt": prompt + [t1], "max_tokens": MAX_TOKENS - 1,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": fresh("nobody")}}
    r = httpx.post(f"{d.url}/v1/completions", json=body, headers=auth_headers(), timeout=60)
    assert r.status_code == 200
    assert [t1] + r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, prompt, MAX_TOKENS)


def test_fail_policy_gives_an_explicit_error(llama_pair: tuple[Worker, Worker],
                                             d_fail: Worker) -> None:
    p, _ = llama_pair
    tid = fresh("fault-corrupt")
    tokens, _, rd = two_legs(p, d_fail, PROMPT[:250], MAX_TOKENS, tid)
    assert rd is not None
    # vLLM turns the failed load (finish_reason "error") into an HTTP 500 with an error body
    assert rd.status_code == 500, rd.text
    assert rd.json()["error"]["type"] == "InternalServerError"
    assert transfer_record(d_fail, tid)["recv"]["cause"] == "checksum_mismatch"


def test_unreachable_decode_worker_frees_prefill_blocks(llama_pair: tuple[Worker, Worker]
                                                        ) -> None:
    p, d = llama_pair
    name = model_name(p)
    closed_port = 9  # discard: nothing listens there on loopback
    body = {"model": name, "prompt": PROMPT[:120], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": fresh("lost"),
                                   "remote_host": "127.0.0.1", "remote_port": closed_port}}
    r = httpx.post(f"{p.url}/v1/completions", json=body, headers=auth_headers(), timeout=60)
    assert r.status_code == 200  # the prefill itself succeeds; the push fails on its own
    wait_drained(p, d)  # the push has given up: its record is final
    rec = transfer_record(p, body["kv_transfer_params"]["transfer_id"])["send"]
    assert rec["status"] == "failed" and rec["cause"] == "peer_unreachable"


@pytest.fixture
def tiny_d(spare_ds: tuple[Worker, Worker]) -> Worker:
    return spare_ds[1]


def test_staging_full_is_refused_before_any_kv_moves(llama_ckpt: Path,
                                                     llama_pair: tuple[Worker, Worker],
                                                     tiny_d: Worker) -> None:
    """A D whose staging area cannot hold the transfer refuses it at BEGIN; the decode leg
    recomputes and P's blocks are freed at once."""
    p, _ = llama_pair
    prompt = PROMPT[:290] + PROMPT[:290] + PROMPT[:290] + PROMPT[:290]  # > 1 MiB of KV
    tid = fresh("big")
    tokens, _, rd = two_legs(p, tiny_d, prompt, 4, tid)
    assert rd is not None and rd.status_code == 200
    assert tokens == hf_greedy(llama_ckpt, prompt, 4)
    assert transfer_record(p, tid)["send"]["cause"] == "refused_staging_full"


def test_internal_routes_require_the_token(llama_pair: tuple[Worker, Worker]) -> None:
    p, d = llama_pair
    # every HTTP path of a worker holding a token, vLLM's own included
    for path in ("/splitserve/info", "/splitserve/state", "/splitserve/transfers/x",
                 "/splitserve/load", "/metrics", "/health", "/v1/models", "/version"):
        assert httpx.get(f"{d.url}{path}", timeout=5).status_code == 401
        bad = {"Authorization": "Bearer not-the-token"}
        assert httpx.get(f"{d.url}{path}", headers=bad, timeout=5).status_code == 401
    info = httpx.get(f"{d.url}/splitserve/info", headers=auth_headers(), timeout=5).json()
    assert info["role"] == "decode" and info["kv_port"] == d.kv_port
    assert info["model_fingerprint"]["num_layers"] == 2
    assert info["chat_format"] == "string"  # how its vLLM renders chats (`chat_rendering`)
    metrics = httpx.get(f"{d.url}/metrics", headers=auth_headers(), timeout=5).text
    assert "splitserve_kv_listener_up 1.0" in metrics
    assert "splitserve_kv_transfers_total" in metrics
    # the router's light load read says what /metrics says (the worker is idle here)
    load = httpx.get(f"{d.url}/splitserve/load", headers=auth_headers(), timeout=5).json()
    assert set(load) == {"kv_usage", "running", "waiting"}
    assert WorkerLoad.from_json(load) == parse_gauges(metrics)
    # P stages nothing: discarding there is refused, with an OpenAI-style error
    r = httpx.delete(f"{p.url}/splitserve/transfers/x", headers=auth_headers(), timeout=5)
    assert r.status_code == 409 and r.json()["error"]["type"] == "invalid_request_error"
