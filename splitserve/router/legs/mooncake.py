"""The leg protocol over vLLM's MooncakeConnector: both legs go at once and D pulls P's blocks
(see `base` for the contract).

- Both legs carry the transfer id the router mints (`transfer_id`); they are sent together
  (`concurrent`): P gets `{"do_remote_decode": true, "transfer_id"}` and `max_tokens: 1`; D gets
  the same prompt with `{"do_remote_prefill": true, "transfer_id", "remote_engine_id",
  "remote_bootstrap_addr"}`. D asks P's bootstrap server for P's ranks, waits for P's prefill
  and pulls the blocks it lacks (its own prefix-cache hit is not pulled), then generates t1
  again (`replayed = 1`), which `Flow` checks against P's t1 and drops.
- P's engine id is not in P's answer: it is read from P's bootstrap server (`GET /query` on the
  port P's `/splitserve/info` advertises as `kv_port`, on P's host) on every good health check
  of P, so a restarted P (a new engine id) is known again after its first good check. Until
  then `open` gives None and D recomputes (exact, slower).
- Release: the D leg `Flow` sent with P's is closed, which aborts it in vLLM; D's connector
  then tells P to free the blocks, and P frees unread blocks anyway after
  `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` (the deployment's `--kv-lease`). So `release` only
  marks the transfer. Mooncake keeps no per-transfer record the router could read.
- The bootstrap server is vLLM's and takes no token: keep it on a trusted network.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from splitserve.common.vocab import Connector
from splitserve.common.wire import WorkerInfo
from splitserve.router.http import TRANSPORT_ERRORS
from splitserve.router.legs.base import DecodeStart, LegProtocol, Transfer
from splitserve.router.worker import Worker

log = logging.getLogger("splitserve.router")


def bootstrap_address(url: str, info: WorkerInfo) -> str | None:
    """P's bootstrap server, on the host of P's URL (the server listens on every interface)
    at the port P advertises; None without one."""
    if not info.kv_port:
        return None
    host = urlsplit(url).hostname or info.kv_host
    if host and ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{info.kv_port}"


def engine_id_of(answer: Any) -> str:
    """P's engine id from its bootstrap server's `/query` answer (data-parallel rank 0's);
    ValueError when the answer has none (P's ranks have not registered yet)."""
    if not isinstance(answer, dict) or not answer:
        raise ValueError("no engine registered with the bootstrap server yet")
    entry = answer.get("0", next(iter(answer.values())))
    engine = entry.get("engine_id") if isinstance(entry, dict) else None
    if not isinstance(engine, str) or not engine:
        raise ValueError(f"bootstrap answer without an engine id: {str(answer)[:200]}")
    return engine


class MooncakeLegs(LegProtocol):
    connector = Connector.MOONCAKE
    concurrent = True

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 2.0) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self.engines: dict[str, str] = {}  # P's URL -> its engine id, as its bootstrap says

    def endpoint(self, info: WorkerInfo) -> dict[str, Any] | None:
        if not info.kv_port:
            return None
        return {"remote_bootstrap_port": info.kv_port, "transport": info.transport}

    async def poll_prefill(self, p: Worker) -> None:
        address = None if p.info is None else bootstrap_address(p.url, p.info)
        if address is None:
            self.engines.pop(p.url, None)
            return
        try:
            async with self.session.get(
                    f"{address}/query",
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                raw = await r.read()
            if r.status != 200:
                raise ValueError(f"bootstrap /query answered {r.status}")
            engine = engine_id_of(json.loads(raw))
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            if self.engines.pop(p.url, None) is not None:
                log.info("worker %s: Mooncake engine id not known now: %s", p.url, exc)
            return
        if self.engines.get(p.url) not in (None, engine):
            log.info("worker %s: Mooncake engine id changed (restarted)", p.url)
        self.engines[p.url] = engine

    def open(self, p: Worker, d: Worker, transfer_id: str, d_cached: int = 0
             ) -> Transfer | None:
        engine = self.engines.get(p.url)
        address = None if p.info is None else bootstrap_address(p.url, p.info)
        if engine is None or address is None:
            return None
        return Transfer(self, transfer_id, p, d,
                        {"do_remote_decode": True, "transfer_id": transfer_id},
                        decode_params={"do_remote_prefill": True, "transfer_id": transfer_id,
                                       "remote_engine_id": engine,
                                       "remote_bootstrap_addr": address})

    def received(self, transfer: Transfer, answer: dict[str, Any]) -> None:
        """Nothing of P's answer is needed: D's parameters were fixed when the legs went out."""

    def decode_start(self, transfer: Transfer, produced: list[int]) -> DecodeStart:
        return DecodeStart(transfer.decode_params, replayed=1)

    def release(self, transfer: Transfer) -> None:
        transfer.released = True
