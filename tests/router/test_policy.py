"""Worker choice: prompt-length-aware P, load-aware D, round-robin, colocated balancing."""

from __future__ import annotations

import pytest

from splitserve.common.load import parse_metrics as parse_gauges
from splitserve.common.wire import WorkerLoad
from splitserve.router.health import Worker
from splitserve.router.policy import NoWorker, Overloaded, Picker


def w(url: str, role: str = "decode", **state: float) -> Worker:
    worker = Worker(url, role, healthy=True)
    for k, v in state.items():
        setattr(worker, k, v)
    return worker


def test_prefill_goes_where_the_fewest_prompt_tokens_wait() -> None:
    a, b = w("a", "prefill", inflight_prefill_tokens=4000), w("b", "prefill")
    b.acquire(1000)
    assert Picker("load", "load").prefill([a, b], 500) is b
    b.acquire(3500)
    assert Picker("load", "load").prefill([a, b], 500) is a


def test_decode_by_kv_staging_and_running_batch() -> None:
    full_kv = w("a", kv_usage=0.95)
    staged = w("b", staged_bytes=900.0, staging_capacity_bytes=1000.0)
    idle = w("c", kv_usage=0.1)
    pick = Picker("load", "load")
    assert pick.decode([full_kv, staged, idle]) is idle
    for _ in range(32):
        idle.acquire()
    assert pick.decode([full_kv, staged, idle]) is staged
    # a D whose staging cannot hold this prompt is skipped while another can
    assert pick.decode([staged, full_kv], kv_bytes=500) is full_kv


def test_round_robin_and_colocated() -> None:
    ws = [w("a"), w("b"), w("c")]
    pick = Picker("round_robin", "round_robin")
    assert [pick.decode(ws).url for _ in range(4)] == ["a", "b", "c", "a"]
    assert [pick.prefill(ws, 10).url for _ in range(2)] == ["a", "b"]
    ws[0].acquire()
    assert {pick.colocated(ws).url for _ in range(4)} == {"b", "c"}
    with pytest.raises(NoWorker):
        pick.colocated([])


def test_routable_and_drain_bookkeeping() -> None:
    worker = w("a")
    assert worker.routable
    worker.draining = True
    assert not worker.routable
    worker.acquire(10)
    assert not worker.drained.is_set()
    worker.release(10)
    assert worker.drained.is_set() and worker.inflight_prefill_tokens == 0


def test_parse_vllm_gauges() -> None:
    text = ('# HELP vllm:kv_cache_usage_perc x\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting_by_reason{reason="x"} 9.0\n')
    assert parse_gauges(text) == WorkerLoad(kv_usage=0.25, running=3.0, waiting=1.0)


def test_queue_limit_skips_full_workers_then_refuses_with_overloaded() -> None:
    a, b = w("a", "prefill"), w("b", "prefill")
    pick = Picker("load", "load", max_per_worker=2)
    for _ in range(2):
        a.acquire(10)
    assert pick.prefill([a, b], 10) is b  # a is at its limit, whatever its score
    for _ in range(2):
        b.acquire(1)
    with pytest.raises(Overloaded) as err:
        pick.prefill([a, b], 10)
    assert isinstance(err.value, NoWorker) and err.value.role == "prefill"
    d = w("d")
    d.acquire()
    d.acquire()
    with pytest.raises(Overloaded):
        pick.decode([d])
    with pytest.raises(Overloaded):
        pick.colocated([d])
    d.release()
    assert pick.decode([d]) is d and pick.colocated([d]) is d
    # an empty pool is not overload: it is a missing worker
    with pytest.raises(NoWorker) as missing:
        pick.decode([])
    assert not isinstance(missing.value, Overloaded)
