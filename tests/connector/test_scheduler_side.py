"""vLLM's scheduler side of the connector, alone: what it asks the worker side to push, load and
cancel, step by step, and when P's blocks stay held. vLLM's scheduler objects are stood in for
by the few fields `SchedulerSide` reads (vLLM's own `CachedRequestData` is used as is)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest

from splitserve.connector.donetable import DoneTable, table_path
from splitserve.connector.meta import LoadSpec, SaveSpec, SplitserveMeta
from splitserve.connector.scheduler_side import SchedulerSide
from tests.support.scheduler import (
    Blocks,
    NewReq,
    Output,
    Request,
    Step,
    cached,
    decode_request,
    prefill_request,
)


@pytest.fixture
def done_path() -> Iterator[str]:
    path = table_path(f"sched-test-{uuid.uuid4().hex[:8]}")
    table = DoneTable(path, create=True)
    yield path
    table.close()


def test_chunked_prefill_pushes_every_token_range_and_holds_blocks_until_sent(
        done_path: str) -> None:
    side = SchedulerSide("tcp", [done_path])
    req = prefill_request("p1", 300)
    side.on_new_request(req)
    meta = side.build_connector_meta(Step({"p1": 256}, [NewReq("p1", ([4, 9],))]))
    assert meta.saves == [SaveSpec("p1", "t-p1", "10.0.0.2", 7001, "tcp", (4, 9), 0, 256, 300)]
    assert meta.saves[0].first and not meta.saves[0].last and not meta.idle
    meta = side.build_connector_meta(Step({"p1": 44},
                                          scheduled_cached_reqs=cached("p1", 256, [2, 6])))
    assert meta.saves == [SaveSpec("p1", "t-p1", "10.0.0.2", 7001, "tcp", (4, 9, 2, 6), 256,
                                   300, 300)]
    assert meta.saves[0].last and not meta.saves[0].first
    assert side.request_finished(req, [4, 9, 2, 6]) == (
        True, {"transfer_id": "t-p1", "pushed_tokens": 300})
    assert side.has_pending_push_work()
    side.update_connector_output(Output({"p1"}))
    assert not side.has_pending_push_work()


def test_prefix_cached_tokens_are_pushed_and_the_transport_defaults(done_path: str) -> None:
    """A prompt P had partly cached still sends from token 0; an unknown transport gives way
    to the worker's default, a known one is kept."""
    side = SchedulerSide("shm", [done_path])
    side.on_new_request(prefill_request("a", 100, transport="carrier-pigeon"))
    side.on_new_request(prefill_request("b", 100, transport="tcp"))
    meta = side.build_connector_meta(Step({"a": 36, "b": 100},
                                          [NewReq("a", ([1, 2],), num_computed_tokens=64),
                                           NewReq("b", ([3, 5],))]))
    assert [(s.request_id, s.transport, s.start, s.end) for s in meta.saves] == [
        ("a", "shm", 0, 100), ("b", "tcp", 0, 100)]


def test_preempted_push_is_cancelled_and_not_resumed(done_path: str) -> None:
    side = SchedulerSide("tcp", [done_path])
    req = prefill_request("p", 300)
    side.on_new_request(req)
    side.build_connector_meta(Step({"p": 128}, [NewReq("p", ([0],))]))
    meta = side.build_connector_meta(Step(preempted_req_ids={"p"}))
    assert meta.cancels == ["p"] and meta.saves == [] and meta.idle
    meta = side.build_connector_meta(Step({"p": 300}, scheduled_cached_reqs=cached(
        "p", 0, [7, 8, 9], resumed=True)))
    assert meta.saves == []
    held, params = side.request_finished(req, [7, 8, 9])
    assert held and params is not None and params["transfer_id"] == "t-p"
    side.update_connector_output(Output({"p"}))  # the worker side settled the cancelled push
    assert not side.has_pending_push_work()


def test_prefill_finished_before_any_save_frees_its_blocks(done_path: str) -> None:
    side = SchedulerSide("tcp", [done_path])
    req = prefill_request("q", 50)
    side.on_new_request(req)
    assert side.request_finished(req, []) == (False, {"transfer_id": "t-q", "pushed_tokens": 0})
    assert not side.has_pending_push_work()


def test_plain_requests_are_left_alone(done_path: str) -> None:
    side = SchedulerSide("tcp", [done_path])
    req = Request("plain", list(range(20)))
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, Blocks([1]), 0)
    meta = side.build_connector_meta(Step({"plain": 20}, [NewReq("plain", ([1],))]))
    assert meta == SplitserveMeta()
    assert side.request_finished(req, [1]) == (False, None)


def stamped(loads: list[LoadSpec], since: float) -> list[LoadSpec]:
    """`loads` with their `scheduled_s` checked (stamped by `update_state_after_alloc`, between
    `since` and now) and cleared, to compare with specs built by hand."""
    for ld in loads:
        assert ld.scheduled_s is not None and since <= ld.scheduled_s <= time.time(), ld
    return [replace(ld, scheduled_s=None) for ld in loads]


def test_decode_load_waits_for_a_transfer_not_yet_complete(done_path: str) -> None:
    """Prompt + [t1] of 301 tokens: 300 come from P, less D's own 128-token prefix hit;
    asynchronous (not in the done table), claimed once."""
    side = SchedulerSide("tcp", [done_path])
    req = decode_request("d", 301)
    assert side.get_num_new_matched_tokens(req, 128) == (172, True)
    since = time.time()
    side.update_state_after_alloc(req, Blocks([5, 6, 7]), 172)
    meta = side.build_connector_meta(Step())
    assert stamped(meta.loads, since) == [LoadSpec("d", "t-d", (5, 6, 7), 128, 300, sync=False)]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # claimed: never again
    assert side.build_connector_meta(Step()).loads == []
    assert side.request_finished(req, [5, 6, 7]) == (False, None)
    assert side.build_connector_meta(Step()).loads == []  # claimed loads are not released


def test_decode_load_of_a_complete_transfer_is_synchronous(done_path: str) -> None:
    DoneTable(done_path, create=False).mark("t-s")
    side = SchedulerSide("tcp", [done_path])
    req = decode_request("s", 65)
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)
    since = time.time()
    side.update_state_after_alloc(req, Blocks([3, 4]), 64)
    assert stamped(side.build_connector_meta(Step()).loads, since) == [
        LoadSpec("s", "t-s", (3, 4), 0, 64, sync=True)]


def test_nothing_to_load_still_releases_the_staged_transfer(done_path: str) -> None:
    """D had the whole prompt cached: the load is empty, so the worker side only releases
    the staged KV; a decode request that finished before claiming gets one release too."""
    side = SchedulerSide("tcp", [done_path])
    full = decode_request("f", 65)
    assert side.get_num_new_matched_tokens(full, 64) == (0, False)
    since = time.time()
    side.update_state_after_alloc(full, Blocks([]), 0)
    assert stamped(side.build_connector_meta(Step()).loads, since) == [
        LoadSpec("f", "t-f", (), 64, 64)]
    gone = decode_request("g", 65)
    side.request_finished(gone, [])
    side.request_finished(gone, [])
    assert side.build_connector_meta(Step()).loads == [LoadSpec("g", "t-g", (), 0, 0)]
