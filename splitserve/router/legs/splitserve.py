"""The leg protocol of splitserve's own connector: P pushes the KV to D as it computes it.

- P's leg names the transfer and D's KV endpoint (from D's `/splitserve/info`):
  `{"do_remote_decode": true, "transfer_id", "remote_host", "remote_port", "remote_engine_id",
  "transport"}`, and `"skip_tokens": d_cached` when the router expects D's prefix cache to hold
  the prompt's first `d_cached` tokens: P then pushes only the rest. D loads from its own hit; a
  hit short of `skip_tokens` (the expectation was stale) fails D's load, which D recomputes.
  A D of several tensor-parallel ranks (its fingerprint's `tp_size`) adds `"remote_tp"`.
- D's leg claims the transfer: `{"do_remote_prefill": true, "transfer_id"}`, plus P's
  `"prefill_tp"` when P has several ranks; D is sent prompt + [t1]. Nothing else of P's
  answer is needed beyond its tokens.
- Release: `DELETE /splitserve/transfers/{id}` on D frees the staged KV (or refuses a push not
  begun); D's lease frees it anyway if that request is lost.
- Record: `GET /splitserve/transfers/{id}` on D.
- Staging: `GET /splitserve/state` on D (`ConnectorState`), polled by the health loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from splitserve.common.vocab import TERMINAL_STATUSES, Connector
from splitserve.common.wire import ConnectorState, SideRecord, TransferRecord, WorkerInfo
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.legs.base import Getter, LegProtocol, Transfer, advertised_endpoint
from splitserve.router.worker import Staging, Worker

log = logging.getLogger("splitserve.router")
FINAL_STATUS = TERMINAL_STATUSES  # D's record can no longer change


def push_target(info: WorkerInfo, transport: str | None = None) -> dict[str, Any] | None:
    """Where P pushes to D (`info`: D's): its KV listener, over `transport` when one is chosen
    per transfer (else what D advertises); None when D has no KV endpoint."""
    endpoint = advertised_endpoint(info)
    if endpoint is not None and transport:
        endpoint["transport"] = transport
    return endpoint


class SplitserveLegs(LegProtocol):
    connector = Connector.SPLITSERVE

    def __init__(self, session: aiohttp.ClientSession, token: str | None,
                 transport: str | None = None) -> None:
        self.session = session  # its default headers carry the deployment token
        self.token = token  # the transfer routes need it: without one, no release or record
        self.transport = transport  # per-transfer transport; None: what D advertises
        self._releases: set[asyncio.Task[None]] = set()  # in-flight DELETEs (kept referenced)

    def open(self, p: Worker, d: Worker, transfer_id: str, d_cached: int = 0
             ) -> Transfer | None:
        endpoint = None if d.info is None else push_target(d.info, self.transport)
        if endpoint is None or d.info is None:
            return None
        params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": transfer_id,
                                  **endpoint}
        if d_cached > 0:
            params["skip_tokens"] = d_cached
        d_tp = (d.info.model_fingerprint or {}).get("tp_size", 1)
        if isinstance(d_tp, int) and d_tp > 1:
            params["remote_tp"] = d_tp
        return Transfer(self, transfer_id, p, d, params)

    def received(self, transfer: Transfer, answer: dict[str, Any]) -> None:
        transfer.decode_params = {"do_remote_prefill": True,
                                  "transfer_id": transfer.transfer_id}
        p_tp = (answer.get("kv_transfer_params") or {}).get("prefill_tp", 1)
        if isinstance(p_tp, int) and p_tp > 1:
            transfer.decode_params["prefill_tp"] = p_tp

    async def poll_staging(self, get: Getter) -> Staging | None:
        status, raw = await get("/splitserve/state")
        if status != 200:
            return None
        state = ConnectorState.from_json(json.loads(raw))
        return Staging(state.staged_bytes, state.staging_capacity_bytes)

    def release(self, transfer: Transfer) -> None:
        if transfer.released:
            return
        transfer.released = True
        if not self.token:
            return
        url = f"{transfer.decode.url}/splitserve/transfers/{transfer.transfer_id}"

        async def send() -> None:
            try:
                async with self.session.delete(url, timeout=aiohttp.ClientTimeout(total=2.0)
                                               ) as r:
                    await r.read()
            except TRANSPORT_ERRORS as exc:  # the lease frees it anyway
                log.info("could not discard transfer %s on %s: %s", transfer.transfer_id,
                         transfer.decode.url, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def record(self, transfer: Transfer, at_url: str,
                     timeout_s: float = 0.5) -> SideRecord | None:
        """D's side of the transfer (`recv`), from its `TransferRecord`; None when D has none
        or its answer is out of shape (logged)."""
        if not self.token:
            return None
        try:
            async with self.session.get(
                    f"{at_url}/splitserve/transfers/{transfer.transfer_id}",
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                raw = await r.read()
            if r.status != 200:
                return None
            return TransferRecord.from_json(json.loads(raw)).recv
        except (*TRANSPORT_ERRORS, ValueError) as exc:  # ValueError: not JSON, or WireError
            log.info("no transfer record for %s: %s", transfer.transfer_id, exc)
            return None

    def record_final(self, record: SideRecord) -> bool:
        return record.final
