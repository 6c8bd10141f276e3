"""Stand-ins for the few fields of vLLM's scheduler objects that the connector's scheduler side
reads (a request, its blocks, a step's `SchedulerOutput`); vLLM's own `CachedRequestData` is used
as is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.output import CachedRequestData


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


@dataclass
class Step:
    """The fields of vLLM's SchedulerOutput the scheduler side reads."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData.make_empty)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class Output:
    finished_sending: set[str] | None = None


def cached(rid: str, computed: int, new_blocks: list[int] | None, resumed: bool = False
           ) -> CachedRequestData:
    return CachedRequestData(req_ids=[rid], resumed_req_ids={rid} if resumed else set(),
                             new_token_ids=[], all_token_ids={},
                             new_block_ids=[(new_blocks,) if new_blocks is not None else None],
                             num_computed_tokens=[computed], num_output_tokens=[0])


def prefill_request(rid: str, n: int, **params: Any) -> Request:
    return Request(rid, list(range(n)), {"do_remote_decode": True, "transfer_id": f"t-{rid}",
                                         "remote_host": "10.0.0.2", "remote_port": 7001,
                                         **params})


def decode_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), {"do_remote_prefill": True, "transfer_id": f"t-{rid}"})
