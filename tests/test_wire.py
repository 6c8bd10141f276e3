"""The router-worker messages (`common.wire`): each type survives its JSON round trip, parses
the answers workers serve, and refuses every malformed field with `WireError`; the vocabularies
(`common.vocab`) have one terminal set, which the router's leg protocol uses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from splitserve.common.load import parse_metrics
from splitserve.common.vocab import (
    TERMINAL_STATUSES,
    Connector,
    Pool,
    Role,
    TransferStatus,
    values,
)
from splitserve.common.wire import (
    ConnectorState,
    SideRecord,
    TransferCounters,
    TransferRecord,
    WireError,
    WorkerInfo,
    WorkerLoad,
)
from splitserve.router.legs.splitserve import FINAL_STATUS

INFO: dict[str, Any] = {
    "connector": "splitserve", "role": "decode", "transport": "tcp", "kv_host": "127.0.0.1",
    "kv_port": 7001, "kv_tls": False, "engine_id": "e1",
    "model_fingerprint": {"num_layers": 2}, "vllm_version": "0.32.0"}
NIXL_INFO: dict[str, Any] = {
    "connector": "nixl", "role": "prefill", "transport": "nixl", "kv_host": "10.0.0.2",
    "kv_port": 5600, "progress_delay_us": 10000, "vllm_version": "0.32.0",
    "kv_events": True, "block_size": 128, "chat_format": "openai",
    "chat_template_sha256": "ab" * 32}
STATE: dict[str, Any] = {
    **INFO, "staged_bytes": 4096, "staging_capacity_bytes": 1 << 20,
    "staging_free_bytes": (1 << 20) - 4096, "open_leases": 1, "claimed_transfers": 0,
    "pending_loads": 0, "held_sends": 2,
    "transfers": {"counts": {"recv_complete": 3, "recv_aborted": 1},
                  "failures": {"aborted_by_prefill": 1}, "bytes_total": {"recv": 12288},
                  "seconds_total": {"recv": 0.25}}}
RECV: dict[str, Any] = {
    "transfer_id": "t1", "side": "recv", "status": "loaded", "tokens": 10, "bytes": 4096,
    "cause": None, "started_s": 100.0, "first_byte_s": 100.1, "complete_s": 100.5,
    "load_s": 0.01, "loaded_tokens": 10, "load_mode": "async", "wire_s": 0.2,
    "scheduled_s": 100.2,
    "duration_s": 0.5, "tail_s": 0.05, "gbps": 2e-5}


def over_json(raw: Any) -> Any:
    """What crosses HTTP: the value through JSON and back."""
    return json.loads(json.dumps(raw))


def test_vocabularies_are_defined_once_and_the_router_waits_for_their_terminal_set() -> None:
    assert values(Role) == ("prefill", "decode", "both")
    assert values(Pool) == ("prefill", "decode", "colocated")
    assert values(Connector) == ("splitserve", "nixl", "mooncake")
    assert {s for s in TransferStatus if not s.terminal} == {"open", "complete"}
    assert FINAL_STATUS == TERMINAL_STATUSES
    assert {"aborted", "refused", "cancelled"} <= TERMINAL_STATUSES
    assert [p.worker_role for p in Pool] == [Role.PREFILL, Role.DECODE, None]


@pytest.mark.parametrize("raw", [INFO, NIXL_INFO])
def test_info_round_trips(raw: dict[str, Any]) -> None:
    info = WorkerInfo.from_json(over_json(raw))
    assert over_json(info.to_json()) == {"kv_tls": False, **raw}
    assert WorkerInfo.from_json(over_json(info.to_json())) == info


def test_info_without_a_connector_is_splitserve_and_keeps_an_endpoint_key() -> None:
    info = WorkerInfo.from_json({"role": "both"})
    assert info.connector is Connector.SPLITSERVE and info.role is Role.BOTH
    assert info.to_json() == {"connector": "splitserve", "role": "both", "kv_host": None,
                              "kv_port": None, "kv_tls": False}


@pytest.mark.parametrize(("key", "value"), [
    ("connector", "vllm"), ("connector", None), ("role", "colocated"), ("role", None),
    ("transport", 3), ("kv_host", ["h"]), ("kv_port", "7001"), ("kv_port", 0),
    ("kv_port", 70000), ("kv_port", -1), ("kv_port", True), ("kv_tls", "yes"), ("kv_tls", 1),
    ("engine_id", 5), ("model_fingerprint", "fp"), ("vllm_version", 0.32),
    ("progress_delay_us", -5), ("progress_delay_us", 1.5), ("kv_events", 1),
    ("block_size", 0), ("block_size", "128"), ("chat_format", "text"), ("chat_format", 1),
    ("chat_template_sha256", 5),
])
def test_info_refuses_each_bad_field(key: str, value: Any) -> None:
    with pytest.raises(WireError, match=key):
        WorkerInfo.from_json({**INFO, key: value})


def test_info_that_reports_its_cache_names_its_block_size() -> None:
    with pytest.raises(WireError, match="block_size"):
        WorkerInfo.from_json({**INFO, "kv_events": True})


@pytest.mark.parametrize("raw", [None, [], "info", 3])
def test_every_type_refuses_what_is_not_an_object(raw: Any) -> None:
    for cls in (WorkerInfo, WorkerLoad, ConnectorState, TransferCounters, SideRecord,
                TransferRecord):
        with pytest.raises(WireError, match="object"):
            cls.from_json(raw)


def test_load_round_trips_and_leaves_unpublished_gauges_out() -> None:
    load = WorkerLoad.from_json({"kv_usage": 0.5, "running": 2, "waiting": 0})
    assert load == WorkerLoad(0.5, 2.0, 0.0)
    assert WorkerLoad.from_json(over_json(load.to_json())) == load
    assert WorkerLoad.from_json({"running": 1}).to_json() == {"running": 1.0}
    assert WorkerLoad().to_json() == {}


def test_a_metrics_page_parses_into_the_same_load() -> None:
    page = "\n".join([
        "# HELP vllm:num_requests_running running", 'vllm:num_requests_running{e="0"} 2.0',
        'vllm:num_requests_running{e="1"} 1.0', 'vllm:kv_cache_usage_perc{e="0"} 0.25',
        "vllm:other 9.0", "vllm:num_requests_waiting{e=\"0\"} not-a-number"])
    assert parse_metrics(page) == WorkerLoad(kv_usage=0.25, running=3.0, waiting=None)
    assert parse_metrics("") == WorkerLoad()


@pytest.mark.parametrize(("key", "value"), [
    ("kv_usage", "0.5"), ("running", True), ("waiting", [1]), ("running", float("nan")),
])
def test_load_refuses_each_bad_gauge(key: str, value: Any) -> None:
    with pytest.raises(WireError, match=key):
        WorkerLoad.from_json({key: value})


def test_state_round_trips() -> None:
    state = ConnectorState.from_json(over_json(STATE))
    assert state.info == WorkerInfo.from_json(INFO) and state.held_sends == 2
    assert state.transfers.counts == {"recv_complete": 3, "recv_aborted": 1}
    assert over_json(state.to_json()) == STATE
    assert ConnectorState.from_json(over_json(state.to_json())) == state


def test_a_worker_of_two_ranks_is_their_states_summed_under_rank_0s_identity() -> None:
    rank0 = ConnectorState.from_json(STATE)
    rank1 = ConnectorState.from_json({**INFO, "tp_rank": 1, "staged_bytes": 1000,
                                      "held_sends": 1, "transfers": {
                                          "counts": {"recv_complete": 2, "send_complete": 5},
                                          "bytes_total": {"recv": 100},
                                          "seconds_total": {"recv": 0.5}}})
    whole = ConnectorState.of_ranks([rank0, rank1])
    assert whole.info == rank0.info
    assert (whole.staged_bytes, whole.held_sends, whole.open_leases) == (5096, 3, 1)
    assert whole.transfers.counts == {"recv_complete": 5, "recv_aborted": 1, "send_complete": 5}
    assert whole.transfers.failures == {"aborted_by_prefill": 1}
    assert whole.transfers.bytes_total == {"recv": 12388}
    assert whole.transfers.seconds_total == {"recv": 0.75}
    assert ConnectorState.of_ranks([rank0]) == rank0
    with pytest.raises(ValueError, match="at least one rank"):
        ConnectorState.of_ranks([])


def test_a_state_without_counts_is_a_drained_worker() -> None:
    state = ConnectorState.from_json({"role": "prefill"})
    assert all(getattr(state, k) == 0 for k in ConnectorState.COUNTS)
    assert state.transfers == TransferCounters()


@pytest.mark.parametrize("key", ConnectorState.COUNTS)
@pytest.mark.parametrize("value", [-1, 1.5, "3", None, True])
def test_state_refuses_each_bad_count(key: str, value: Any) -> None:
    with pytest.raises(WireError, match=key):
        ConnectorState.from_json({**STATE, key: value})


@pytest.mark.parametrize(("table", "bad"), [
    ("counts", {"recv_complete": 1.5}), ("counts", {"recv_complete": -1}),
    ("failures", {"peer_gone": "2"}), ("bytes_total", {"recv": None}),
    ("seconds_total", {"recv": "0.5"}), ("counts", [1]),
])
def test_state_refuses_each_bad_counter(table: str, bad: Any) -> None:
    with pytest.raises(WireError, match=table):
        ConnectorState.from_json({**STATE, "transfers": {**STATE["transfers"], table: bad}})


def test_state_refuses_a_bad_identity() -> None:
    with pytest.raises(WireError, match="role"):
        ConnectorState.from_json({**STATE, "role": "router"})
    with pytest.raises(WireError, match="transfers"):
        ConnectorState.from_json({**STATE, "transfers": "none"})


def test_record_round_trips_and_says_when_it_is_final() -> None:
    rec = SideRecord.from_json(over_json(RECV))
    assert rec.status is TransferStatus.LOADED and rec.final and rec.tokens == 10
    assert SideRecord.from_json(over_json(rec.to_json())) == rec
    assert over_json(rec.to_json())["status"] == "loaded"
    for status in TransferStatus:
        assert SideRecord("t", "send", status).final == (status in TERMINAL_STATUSES)


@pytest.mark.parametrize(("key", "value"), [
    ("transfer_id", None), ("transfer_id", 7), ("transfer_id", ""), ("side", "both"),
    ("side", None), ("status", "loading"), ("status", None), ("tokens", -1), ("tokens", 1.5),
    ("bytes", "4096"), ("cause", 3), ("started_s", "now"), ("gbps", True),
    ("loaded_tokens", 2.5), ("load_mode", 1), ("tail_s", [0.1]), ("scheduled_s", "soon"),
])
def test_record_refuses_each_bad_field(key: str, value: Any) -> None:
    with pytest.raises(WireError, match=key):
        SideRecord.from_json({**RECV, key: value})


def test_transfer_record_round_trips_both_sides() -> None:
    send = {**RECV, "side": "send", "status": "complete", "sender_sends_s": 0.1}
    raw = {"transfer_id": "t1", "recv": RECV, "send": send}
    rec = TransferRecord.from_json(over_json(raw))
    assert rec.recv is not None and rec.send is not None and not rec.send.final
    assert TransferRecord.from_json(over_json(rec.to_json())) == rec
    only_d = TransferRecord.from_json({"transfer_id": "t1", "recv": RECV})
    assert only_d.send is None and "send" not in only_d.to_json()


@pytest.mark.parametrize("raw", [
    {"recv": RECV},  # no id
    {"transfer_id": "t2", "recv": RECV},  # another transfer's record
    {"transfer_id": "t1", "recv": {**RECV, "side": "send"}},  # the wrong side
    {"transfer_id": "t1", "recv": "loaded"},
    {"transfer_id": "t1", "send": {**RECV, "status": "?"}},
])
def test_transfer_record_refuses_a_bad_side(raw: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        TransferRecord.from_json(raw)
