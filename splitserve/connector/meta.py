"""What crosses from vLLM's scheduler side to its worker side each step: `SplitserveMeta`
(built by `scheduler_side.SchedulerSide`, read by `worker_side.WorkerSide`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class SaveSpec:
    request_id: str
    transfer_id: str
    host: str
    port: int
    transport: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    prompt_len: int
    skip: int = 0  # the transfer's first token: D's prefix cache is to hold [0, skip)
    decode_tp: int = 1  # D's ranks: rank d listens on `port + d` (`connector.ranks`)

    @property
    def first(self) -> bool:
        """The transfer's first chunk (its BEGIN goes out with it)."""
        return self.start == self.skip

    @property
    def last(self) -> bool:
        return self.end >= self.prompt_len


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    start: int
    end: int  # start == end: nothing to load, just release the staged transfer
    sync: bool = False  # complete at scheduling time: load before this step's forward
    prefill_tp: int = 1  # P's ranks: with more than D's, each D rank gets several pieces
    # wall time (epoch s) D's scheduler gave the request its blocks: for a sync load, the start
    # of the step that computes it
    scheduled_s: float | None = None


@dataclass
class SplitserveMeta(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # request ids
    idle: bool = False  # the step computes nothing: it runs only to collect transfer results
