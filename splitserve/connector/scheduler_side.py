"""vLLM's scheduler side of the connector (EngineCore process): decides what to push and what
to load.

Per step it hands the worker side a `SplitserveMeta`:
- saves: for each prefill-leg request (`do_remote_decode`) scheduled this step, the token range to
  push after each layer. The first range starts at the request's `skip_tokens` (the prefix the
  router expects D's prefix cache to hold; 0 when absent), at most the prompt's length - 1, so at
  least one token moves: P sends only [skip, prompt_len), including tokens P itself had in its
  prefix cache. A step whose tokens all lie in the skipped prefix pushes nothing; the push
  (BEGIN) opens with the first chunk that reaches past it.
- loads: for each decode-leg request (`do_remote_prefill`) that got blocks, the staged transfer
  to copy into them — synchronously, before this step's forward, if the transfer was already
  complete when the request was scheduled (the DoneTable says so); asynchronously otherwise.
  Start is D's local prefix-cache hit (block-aligned), end is the prompt length P computed
  (decode prompt = P's prompt + [t1]; t1's KV is computed by D itself). The scheduler does not
  know what P skipped: a hit short of the staged transfer's first token (D evicted the prefix,
  or never had it) fails at the worker side as a load error, which vLLM recomputes.
- cancels: prefill requests preempted mid-transfer (their blocks are about to be reused).

Tensor parallelism (`connector.ranks`): P learns D's ranks from `remote_tp` and every P rank
pushes its pieces; P's answer carries `prefill_tp`, which the router hands D, so that D checks
and loads the pieces of that many P ranks on each of its own.

Invariants: `get_num_new_matched_tokens` has no side effects beyond a memo of its last answer
(sync or async) that `update_state_after_alloc` consumes; a request's load is claimed once (in
`update_state_after_alloc`), so a failed load is recomputed rather than retried; a finished
prefill request's blocks are held (`request_finished` -> True) exactly when a save was emitted
for it, and the worker reports it in `finished_sending` once the push is settled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.config import TRANSPORTS
from splitserve.connector.donetable import DoneTable
from splitserve.connector.meta import LoadSpec, SaveSpec, SplitserveMeta
from splitserve.connector.ranks import RankHeads

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Prefill:
    transfer_id: str
    host: str
    port: int
    transport: str
    prompt_len: int
    skip: int = 0  # the first token pushed
    decode_tp: int = 1
    block_ids: list[int] = field(default_factory=list)
    sent_upto: int = 0  # starts at `skip`


def transfer_params(request: Request) -> dict[str, Any]:
    return request.kv_transfer_params or {}


def skip_tokens(params: dict[str, Any], prompt_len: int) -> int:
    """The prompt tokens P does not push (`skip_tokens`): a non-negative int, at most
    `prompt_len - 1` so that the transfer is never empty; 0 when absent or malformed."""
    raw = params.get("skip_tokens", 0)
    if not isinstance(raw, int) or isinstance(raw, bool) or raw <= 0:
        return 0
    return max(0, min(raw, prompt_len - 1))


def tp_param(params: dict[str, Any], key: str) -> int:
    """A tensor-parallel size in the transfer params (`remote_tp`, `prefill_tp`); 1 when absent
    or malformed."""
    raw = params.get(key, 1)
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw > 1 else 1


def decode_transfer_id(request: Request) -> str | None:
    """The transfer a decode-leg request (`do_remote_prefill`) loads from, if it is one."""
    p = transfer_params(request)
    return str(p["transfer_id"]) if p.get("do_remote_prefill") and p.get("transfer_id") else None


class SchedulerSide:
    def __init__(self, default_transport: str, done_table_paths: list[str],
                 heads: RankHeads | None = None) -> None:
        """`done_table_paths`: each rank's DoneTable, rank 0 first; `heads`: rank 0's place
        among the model's KV heads (default: a single rank holding them all)."""
        self._default_transport = default_transport
        self._done_paths = done_table_paths
        self._done: dict[int, DoneTable] = {}
        self._heads = heads or RankHeads(1)
        self._sync_answer: dict[str, bool] = {}  # last answer per request (a memo, not state)
        self._prefills: dict[str, _Prefill] = {}
        self._saving: set[str] = set()  # a save was emitted: blocks are held at finish
        self._awaiting_send: set[str] = set()  # finished, held, not yet reported
        self._load_claimed: set[str] = set()
        self._pending = SplitserveMeta()

    # -- prefill (P) side --------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        p = transfer_params(request)
        if p.get("do_remote_decode") and p.get("transfer_id") and p.get("remote_port"):
            prompt_len = len(request.prompt_token_ids or ())
            skip = skip_tokens(p, prompt_len)
            self._prefills[request.request_id] = _Prefill(
                transfer_id=str(p["transfer_id"]), host=str(p.get("remote_host", "127.0.0.1")),
                port=int(p["remote_port"]),
                transport=(str(p["transport"]) if p.get("transport") in TRANSPORTS
                           else self._default_transport),
                prompt_len=prompt_len, skip=skip, sent_upto=skip,
                decode_tp=tp_param(p, "remote_tp"),
            )

    # -- decode (D) side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        tid = decode_transfer_id(request)
        if tid is None or request.request_id in self._load_claimed:
            return 0, False
        remote = len(request.prompt_token_ids or ()) - 1
        n = remote - num_computed_tokens
        if n <= 0:
            return 0, False
        ready = self._transfer_complete(tid, tp_param(transfer_params(request), "prefill_tp"))
        self._sync_answer[request.request_id] = ready
        return n, not ready

    def _transfer_complete(self, transfer_id: str, prefill_tp: int) -> bool:
        """Whether every rank has every piece of the transfer staged complete (DoneTable)."""
        for rank, path in enumerate(self._done_paths):
            if rank not in self._done:
                table = DoneTable.open_existing(path)
                if table is None:
                    return False
                self._done[rank] = table
            pieces = self._heads.of(rank).staged_pieces(transfer_id, prefill_tp)
            if not all(self._done[rank].contains(sid) for sid, _ in pieces):
                return False
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tid = decode_transfer_id(request)
        if tid is None or request.request_id in self._load_claimed:
            return
        self._load_claimed.add(request.request_id)
        sync = self._sync_answer.pop(request.request_id, False)
        end = len(request.prompt_token_ids or ()) - 1
        start = end - num_external_tokens if num_external_tokens > 0 else end
        block_ids = tuple(blocks.get_block_ids()[0]) if num_external_tokens > 0 else ()
        self._pending.loads.append(LoadSpec(
            request.request_id, tid, block_ids, start, end, sync=sync and start < end,
            prefill_tp=tp_param(transfer_params(request), "prefill_tp"),
            scheduled_s=time.time()))

    # -- every step --------------------------------------------------------------------------
    def build_connector_meta(self, so: SchedulerOutput) -> SplitserveMeta:
        meta, self._pending = self._pending, SplitserveMeta()
        meta.idle = so.total_num_scheduled_tokens == 0
        for new in so.scheduled_new_reqs:
            pf = self._prefills.get(new.req_id)
            if pf is not None:
                pf.block_ids = list(new.block_ids[0])
                self._emit_save(meta, new.req_id, pf,
                                new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            pf = self._prefills.get(rid)
            if pf is None or pf.sent_upto >= pf.prompt_len:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                if rid in self._saving:  # preempted mid-push: the push was cancelled
                    continue
                # preempted before its push began (every chunk so far lay in the skipped
                # prefix): resumed with a new block table, which vLLM hands over whole
                pf.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                pf.block_ids.extend(new_blocks[0])
            self._emit_save(meta, rid, pf,
                            cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid])
        for rid in so.preempted_req_ids or ():
            if rid in self._prefills and rid in self._saving:
                meta.cancels.append(rid)
                self._prefills[rid].sent_upto = self._prefills[rid].prompt_len
        return meta

    def _emit_save(self, meta: SplitserveMeta, rid: str, pf: _Prefill, end: int) -> None:
        end = min(end, pf.prompt_len)
        if end <= pf.sent_upto:
            return
        meta.saves.append(SaveSpec(rid, pf.transfer_id, pf.host, pf.port, pf.transport,
                                   tuple(pf.block_ids), pf.sent_upto, end, pf.prompt_len,
                                   pf.skip, pf.decode_tp))
        pf.sent_upto = end
        self._saving.add(rid)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._sync_answer.pop(rid, None)
        claimed = rid in self._load_claimed
        self._load_claimed.discard(rid)
        pf = self._prefills.pop(rid, None)
        tid = decode_transfer_id(request)
        if tid is not None and not claimed:
            # A decode request that never claimed its transfer (rejected, aborted while
            # queued): release the staged KV now rather than at lease expiry.
            if not any(ld.request_id == rid for ld in self._pending.loads):
                self._pending.loads.append(LoadSpec(
                    rid, tid, (), 0, 0, prefill_tp=tp_param(transfer_params(request),
                                                            "prefill_tp")))
        if pf is None:
            return False, None
        params: dict[str, Any] = {"transfer_id": pf.transfer_id,
                                  "pushed_tokens": pf.sent_upto - pf.skip}
        if self._heads.tp > 1:  # D then expects the pieces of this many ranks
            params["prefill_tp"] = self._heads.tp
        if pf.skip:
            params["skipped_tokens"] = pf.skip
        if rid in self._saving:
            self._awaiting_send.add(rid)
            return True, params
        return False, params

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_sending or ():
            self._awaiting_send.discard(rid)
            self._saving.discard(rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_send)
