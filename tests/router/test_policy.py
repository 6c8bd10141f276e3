"""Worker choice: prompt-length-aware P, load-aware D, round-robin, colocated balancing, and
the shared policies (`splitserve.routing`) as the router offers them."""

from __future__ import annotations

import pytest

from splitserve.common.load import parse_metrics as parse_gauges
from splitserve.common.vocab import Pool
from splitserve.common.wire import WorkerLoad
from splitserve.router.config import DECODE_POLICIES, PREFILL_POLICIES, RouterConfig
from splitserve.router.policy import NoWorker, Overloaded, Picker
from splitserve.router.worker import Staging, Worker
from splitserve.routing import POLICIES, RandomDraws, RouteRequest, WorkerView


def w(url: str, role: str = "decode", kv_usage: float | None = None, staged: int = 0,
      capacity: int = 0) -> Worker:
    worker = Worker(f"http://{url}:1", role)
    worker.health.healthy = True
    worker.load.engine = WorkerLoad(kv_usage=kv_usage)
    worker.load.staging = Staging(staged, capacity)
    return worker


class Scripted:
    """`Draws` that answer from a list."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = iter(answers)

    def index(self, n: int) -> int:
        value = next(self.answers)
        assert 0 <= value < n
        return value


def prompt(n: int, kv_bytes: int = 0) -> RouteRequest:
    return RouteRequest(n, None, kv_bytes)


def name(worker: Worker) -> str:
    return worker.url.removeprefix("http://").removesuffix(":1")


def test_prefill_goes_where_the_fewest_prompt_tokens_wait() -> None:
    a, b = w("a", "prefill"), w("b", "prefill")
    a.acquire(4000)
    b.acquire(1000)
    assert Picker("load", "load").prefill([a, b], prompt(500)) is b
    b.acquire(3500)
    assert Picker("load", "load").prefill([a, b], prompt(500)) is a


def test_decode_by_kv_staging_and_running_batch() -> None:
    full_kv = w("a", kv_usage=0.95)
    staged = w("b", staged=900, capacity=1000)
    idle = w("c", kv_usage=0.1)
    pick = Picker("load", "load")
    assert pick.decode([full_kv, staged, idle]) is idle
    for _ in range(32):
        idle.acquire()
    assert pick.decode([full_kv, staged, idle]) is staged
    # a D whose staging cannot hold this prompt is skipped while another can
    assert pick.decode([staged, full_kv], prompt(10, kv_bytes=500)) is full_kv
    # ... unless it holds enough of the prompt that the delta it stages fits (50 of 500 B)
    held = RouteRequest(10, None, 500, {staged.worker_id: 9})
    assert held.kv_bytes_on(staged.worker_id) == 50 and held.kv_bytes_on("other") == 500
    assert pick.decode([staged, full_kv], held) is staged


def test_round_robin_and_colocated() -> None:
    ws = [w("a"), w("b"), w("c")]
    pick = Picker("round_robin", "round_robin")
    assert [name(pick.decode(ws)) for _ in range(4)] == ["a", "b", "c", "a"]
    assert [name(pick.prefill(ws, prompt(10))) for _ in range(2)] == ["a", "b"]
    ws[0].acquire()
    assert {name(pick.colocated(ws)) for _ in range(4)} == {"b", "c"}
    with pytest.raises(NoWorker):
        pick.colocated([])


def test_routable_and_drain_bookkeeping() -> None:
    worker = w("a")
    assert worker.routable
    worker.draining = True
    assert not worker.routable
    assert worker.drained.is_set()  # no open legs
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
    assert pick.prefill([a, b], prompt(10)) is b  # a is at its limit, whatever its score
    for _ in range(2):
        b.acquire(1)
    with pytest.raises(Overloaded) as err:
        pick.prefill([a, b], prompt(10))
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


def test_the_router_offers_every_registered_policy_by_name() -> None:
    assert PREFILL_POLICIES == tuple(POLICIES[Pool.PREFILL]) and "load" in PREFILL_POLICIES
    assert DECODE_POLICIES == tuple(POLICIES[Pool.DECODE])
    for policy in PREFILL_POLICIES:
        RouterConfig(prefill=("http://p:1",), decode=("http://d:1",), prefill_policy=policy,
                     decode_policy=policy)
        Picker(policy, policy)
    with pytest.raises(ValueError):
        RouterConfig(colocated=("http://c:1",), prefill_policy="no_such_policy")
    with pytest.raises(ValueError, match="prefill policy must be one of"):
        Picker("nope", "load")


def test_random_power_of_two_and_least_loaded_on_the_router() -> None:
    ps = [w("a", "prefill"), w("b", "prefill"), w("c", "prefill")]
    ps[0].acquire(900)
    ps[1].acquire(100)
    least = Picker("least_loaded", "least_loaded")
    assert name(least.prefill(ps, prompt(5))) == "c"  # no prompt tokens queued
    ps[2].acquire(500)
    assert name(least.prefill(ps, prompt(5))) == "b"
    ds = [w("a"), w("b")]
    ds[0].acquire()
    assert name(least.decode(ds)) == "b"  # D: by open legs
    # power_of_two: the less loaded of the two drawn (with replacement; ties: the first)
    two = Picker("power_of_two", "power_of_two", draws=Scripted([0, 2, 0, 0, 2, 1, 1, 1]))
    assert [name(two.prefill(ps, prompt(5))) for _ in range(4)] == ["c", "a", "b", "b"]
    rand = Picker("random", "random", draws=RandomDraws(1))
    assert {name(rand.decode(ds)) for _ in range(50)} == {"a", "b"}


def test_a_router_worker_is_a_worker_view() -> None:
    worker = w("a", kv_usage=0.5, staged=3, capacity=8)
    assert isinstance(worker, WorkerView)
    assert (worker.kv_usage, worker.staged_bytes, worker.staging_capacity_bytes,
            worker.waiting) == (0.5, 3.0, 8.0, 0.0)
