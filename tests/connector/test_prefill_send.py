"""P's send bookkeeping alone, over the in-memory fake channel: which pushes open when, what
each layer hands the channel, and that a request's blocks are reported free only once its
push has settled."""

from __future__ import annotations

import pytest
import torch

from splitserve.config import ConnectorConfig
from splitserve.connector.faults import Faults
from splitserve.connector.layout.cpu import VllmCpuLayout
from splitserve.connector.layout.paged import kv_shape
from splitserve.connector.meta import SaveSpec, SplitserveMeta
from splitserve.connector.prefill_send import PrefillSends
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.stats import ConnectorStats
from tests.support.channels import FakeChannel

NAMES = ("model.layers.0.attn", "model.layers.1.attn")
TOKEN_BYTES = 512  # per layer: K and V, 2 heads, head_dim 32, float32
FP = Fingerprint("cafe", "float32", 2, 2, 32, "0.32.0")


class Setup:
    def __init__(self) -> None:
        torch.manual_seed(5)
        self.caches = [torch.randn(6, 2, 16, 64) for _ in NAMES]  # 16-token blocks
        self.layouts = [VllmCpuLayout(c) for c in self.caches]
        self.channels: dict[tuple[str, int, str], FakeChannel] = {}
        self.sends = PrefillSends(ConnectorConfig(role="prefill"), "token", None, Faults(False),
                                  ConnectorStats(), {n: i for i, n in enumerate(NAMES)},
                                  self.layouts, kv_shape(self.layouts), FP, self.open)

    def open(self, host: str, port: int, transport: str) -> FakeChannel:
        ch = self.channels[(host, port, transport)] = FakeChannel(host, port, transport)
        return ch

    def step(self, *saves: SaveSpec, cancels: tuple[str, ...] = ()) -> None:
        """One engine step as vLLM drives the worker side: bind, forward (each layer), save."""
        meta = SplitserveMeta(saves=list(saves), cancels=list(cancels))
        self.sends.handle_preemptions(meta)
        self.sends.open_sends(meta)
        for name, cache in zip(NAMES, self.caches, strict=True):
            if meta.saves:
                self.sends.save_kv_layer(meta, name, cache)
        self.sends.wait_for_save(meta)


BLOCKS = (4, 0, 5, 2)


def save(rid: str, start: int, end: int, prompt_len: int = 50, port: int = 7001) -> SaveSpec:
    return SaveSpec(rid, f"t-{rid}", "127.0.0.1", port, "shm", BLOCKS, start, end, prompt_len)


def test_chunks_of_every_layer_reach_the_channel_in_the_staging_format() -> None:
    s = Setup()
    s.step(save("r", 0, 32))
    ch = s.channels[("127.0.0.1", 7001, "shm")]
    t = ch.transfers["t-r"]
    assert (t.state.num_tokens, t.state.record.bytes) == (50, 2 * 50 * TOKEN_BYTES) and not t.ended
    s.step(save("r", 32, 50))
    assert t.ended
    assert [(p.layer, p.start, p.end) for p in t.layers] == [(0, 0, 32), (1, 0, 32),
                                                            (0, 32, 50), (1, 32, 50)]
    for p in t.layers:
        ref = torch.empty((p.end - p.start) * TOKEN_BYTES, dtype=torch.uint8)
        s.layouts[p.layer].gather(BLOCKS, p.start, p.end, ref)
        assert p.payload == ref.numpy().tobytes()


def test_blocks_are_reported_free_only_once_the_push_settles() -> None:
    s = Setup()
    s.step(save("r", 0, 50))
    ch = s.channels[("127.0.0.1", 7001, "shm")]
    assert s.sends.finished_sending({"r"}) == set() and s.sends.held == 1  # not acked yet
    assert s.sends.finished_sending(set()) == set()
    ch.settle("t-r", "complete")
    assert s.sends.finished_sending(set()) == {"r"}
    assert s.sends.held == 0 and ch.forgotten == ["t-r"] and not ch.cancelled


def test_a_settled_push_of_a_running_request_waits_for_vllm_to_finish_it() -> None:
    s = Setup()
    s.step(save("r", 0, 50))
    s.channels[("127.0.0.1", 7001, "shm")].settle("t-r", "complete")
    assert s.sends.finished_sending(set()) == set()  # vLLM has not finished the request
    assert s.sends.finished_sending({"r"}) == {"r"}


def test_request_aborted_mid_prefill_cancels_its_push() -> None:
    s = Setup()
    s.step(save("r", 0, 32))
    ch = s.channels[("127.0.0.1", 7001, "shm")]
    assert s.sends.finished_sending({"r"}) == {"r"}  # the fake's cancel settles at once
    assert ch.cancelled == ["t-r"]


def test_preempted_push_is_cancelled_and_its_later_chunks_dropped() -> None:
    s = Setup()
    s.step(save("r", 0, 32))
    ch = s.channels[("127.0.0.1", 7001, "shm")]
    s.step(cancels=("r",))
    assert ch.cancelled == ["t-r"]
    s.step(save("r", 32, 50))  # a stale later chunk: not pushed, END not sent
    t = ch.transfers["t-r"]
    assert len(t.layers) == 2 and not t.ended


def test_one_channel_per_destination() -> None:
    s = Setup()
    s.step(save("a", 0, 50), save("b", 0, 50), save("c", 0, 50, port=7002))
    assert sorted(s.channels) == [("127.0.0.1", 7001, "shm"), ("127.0.0.1", 7002, "shm")]
    assert sorted(s.channels[("127.0.0.1", 7001, "shm")].transfers) == ["t-a", "t-b"]
    s.sends.close()
    assert all(ch.closed for ch in s.channels.values())


def test_a_channel_that_lost_its_d_is_dropped_once_it_carries_nothing() -> None:
    """A D that died (its connection lost) keeps its channel only while a transfer to it is
    unsettled; then the channel is closed and forgotten, a live idle one is kept, and a later
    transfer to the lost address opens a new channel."""
    s = Setup()
    s.step(save("a", 0, 50), save("b", 0, 50, port=7002))
    lost, live = s.channels[("127.0.0.1", 7001, "shm")], s.channels[("127.0.0.1", 7002, "shm")]
    lost.connected = False
    live.settle("t-b", "complete")
    assert s.sends.finished_sending({"a", "b"}) == {"b"}
    assert s.sends.channels == 2 and not lost.closed  # t-a is not settled yet
    lost.settle("t-a", "failed")
    assert s.sends.finished_sending(set()) == {"a"}
    assert lost.closed and not live.closed and s.sends.channels == 1
    s.step(save("c", 0, 50))
    again = s.channels[("127.0.0.1", 7001, "shm")]
    assert again is not lost and "t-c" in again.transfers and s.sends.channels == 2


def test_a_moved_cache_stops_the_engine() -> None:
    s = Setup()
    meta = SplitserveMeta(saves=[save("r", 0, 50)])
    with pytest.raises(RuntimeError, match="moved the KV cache of model.layers.1.attn"):
        s.sends.save_kv_layer(meta, NAMES[1], s.caches[1].clone())
