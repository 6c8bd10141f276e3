"""The leg protocol over vLLM's NixlConnector: D pulls P's blocks (see `base` for the contract).

P's leg offers the prompt's blocks (`do_remote_decode`); P's answer says where they are
(`kv_transfer_params`: `remote_engine_id`, `remote_block_ids`, `remote_host`/`remote_port`,
`remote_num_tokens`, `transfer_mode: pull`), and D's first leg carries them back. D is sent the
prompt alone and generates t1 again (`replayed = 1`), which `Flow` checks against the client's
t1 and drops: NIXL moves whole blocks, and prompt + [t1] needs one block more than P sent
whenever the prompt fills its last block (vLLM 0.32's D then fails an assertion and its engine
dies). An abandoned transfer's blocks stay on P until its KV lease (`kv_lease_duration`, the
deployment's `--kv-lease`) runs out: vLLM frees them sooner only through a D that was handed
them (D tells P when it ends or rejects that request), and P itself has no call for it, so
`release` only marks the transfer. NIXL keeps no per-transfer record the router could read.
"""

from __future__ import annotations

from typing import Any

from splitserve.common.vocab import Connector
from splitserve.router.legs.base import DecodeStart, LegProtocol, Transfer
from splitserve.router.worker import Worker


class NixlLegs(LegProtocol):
    connector = Connector.NIXL

    def open(self, p: Worker, d: Worker, transfer_id: str, d_cached: int = 0
             ) -> Transfer | None:
        return Transfer(self, transfer_id, p, d, {"do_remote_decode": True})

    def received(self, transfer: Transfer, answer: dict[str, Any]) -> None:
        params = answer.get("kv_transfer_params")
        ok = isinstance(params, dict) and params.get("do_remote_prefill")
        transfer.decode_params = dict(params) if ok and isinstance(params, dict) else None

    def decode_start(self, transfer: Transfer, produced: list[int]) -> DecodeStart:
        if transfer.decode_params is None:  # P offered nothing: D recomputes after t1
            return DecodeStart(None)
        return DecodeStart(transfer.decode_params, replayed=1)

    def release(self, transfer: Transfer) -> None:
        transfer.released = True
