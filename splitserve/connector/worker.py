"""The connector's worker side (the process that owns the KV cache).

P: after each layer, hand that layer's KV for the scheduled token range to the channel to D,
which copies it out of P's blocks on this thread once D has opened the transfer (the sender
thread before then, or for fault-marked transfers); P's blocks stay held until the push is
settled. D: a listener receives pushes into the staging area; a decode request's load is
registered in `start_load_kv` and completed in `get_transfer_results` once its transfer is
complete and verified — never blocking the running batch — or reported failed (late, short,
corrupt, refused, peer gone), which vLLM's `kv_load_failure_policy` turns into a recompute or
an error.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger  # noqa: E402

from splitserve.config import ConnectorConfig, load_token
from splitserve.connector.donetable import DoneTable, table_path
from splitserve.connector.faults import Faults
from splitserve.connector.layout.paged import EngineKV, PagedLayout, kv_shape
from splitserve.connector.layout.select import select_layouts
from splitserve.connector.layout.staging_format import KVShape, region_offset
from splitserve.connector.listener import KVListener
from splitserve.connector.protocol import Fingerprint, config_hash
from splitserve.connector.scheduler import LoadSpec, SaveSpec, SplitserveMeta
from splitserve.connector.segment import sweep_orphans
from splitserve.connector.staging import StagedTransfer, StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.tls import client_context, server_context
from splitserve.connector.transport.base import LayerItem, PushChannel, SendState
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel

logger = init_logger(__name__)
IDLE_WAIT_S = 0.001  # per empty engine step while pushes await D's acknowledgement


@dataclass
class _Send:
    channel: PushChannel
    state: SendState
    ended: bool = False
    finished: bool = False  # vLLM finished the request; its blocks are held for us


@dataclass
class _Load:
    spec: LoadSpec
    deadline: float
    staged: StagedTransfer | None = None


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[0]) if found else 0


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, hf_config: dict[str, Any],
                 dtype: torch.dtype, vllm_version: str) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self._token = load_token(required=True) or ""
        # TLS configured: the listener accepts only TLS, and every push this worker makes uses it
        self._tls_server = server_context(cfg)
        self._tls_client = client_context(cfg)
        self._faults = Faults.from_env()
        self._hf_config = hf_config
        self._dtype = dtype
        self._vllm_version = vllm_version
        self.stats = ConnectorStats()
        self._layers: dict[str, int] = {}
        self._layouts: list[PagedLayout] = []
        self.shape: KVShape | None = None
        self.fingerprint: Fingerprint | None = None
        self.staging: StagingArea | None = None
        self.listener: KVListener | None = None
        self._channels: dict[tuple[str, int, str], PushChannel] = {}
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()  # blocks of failed synchronous loads

    # -- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], engine: EngineKV) -> None:
        """Choose and verify the paged layout (refusing a cache no layout reads), then open
        the listener (and, on D, the staging area)."""
        names = sorted(kv_caches, key=_layer_index)
        self._layers = {n: i for i, n in enumerate(names)}
        self._layouts = select_layouts([(n, kv_caches[n]) for n in names], engine)
        first = self._layouts[0]
        self.shape = kv_shape(self._layouts)
        heads, head_dim = self.shape.num_kv_heads, self.shape.head_dim
        logger.info("splitserve connector: role=%s transport=%s kv=%s:%d tls=%s layout=%s "
                    "layers=%d kv_heads=%d head_dim=%d block_size=%d dtype=%s", self.cfg.role,
                    self.cfg.transport, self.cfg.kv_host, self.cfg.kv_port,
                    ("mutual" if self.cfg.tls_ca else "on") if self.cfg.tls_enabled else "off",
                    first.name, len(names), heads, head_dim, first.block_size, first.dtype)
        self.fingerprint = Fingerprint(
            config_hash=config_hash(self._hf_config), dtype=str(self._dtype).replace("torch.", ""),
            num_layers=len(names), num_kv_heads=heads, head_dim=head_dim,
            vllm_version=self._vllm_version,
        )
        if self.cfg.role in ("decode", "both"):
            sweep_orphans()  # what decode workers killed with SIGKILL left in /dev/shm
            self.staging = StagingArea(self.cfg.staging_bytes, self.shape, self.cfg.lease_s,
                                       self.stats, DoneTable(table_path(self.engine_id), True))
        self.listener = KVListener(self.cfg.kv_host, self.cfg.kv_port, self._token,
                                   self.fingerprint, self.staging, self.answer, self._tls_server,
                                   self._faults)

    def answer(self, query: dict[str, Any]) -> dict[str, Any]:
        """The listener's QUERY handler: state, or one transfer's record."""
        if query.get("what") == "transfer":
            rec = self.stats.record(str(query.get("transfer_id", "")))
            return rec if rec is not None else {"error": "unknown transfer"}
        if query.get("what") == "discard":
            if self.staging is None:
                return {"error": "not a decode worker"}
            return {"discarded": self.staging.discard(str(query.get("transfer_id", "")))}
        staging = self.staging.state() if self.staging else {
            "staged_bytes": 0, "staging_capacity_bytes": 0, "staging_free_bytes": 0,
            "open_leases": 0, "claimed_transfers": 0}
        return {
            "role": self.cfg.role, "transport": self.cfg.transport, "kv_host": self.cfg.kv_host,
            "kv_port": self.cfg.kv_port, "kv_tls": self.cfg.tls_enabled,
            "engine_id": self.engine_id,
            "model_fingerprint": self.fingerprint.__dict__ if self.fingerprint else None,
            "vllm_version": self._vllm_version, **staging,
            "pending_loads": len(self._loads), "held_sends": len(self._sends),
            "transfers": self.stats.snapshot(),
        }

    def _channel(self, host: str, port: int, transport: str) -> PushChannel:
        key = (host, port, transport)
        if key not in self._channels:
            assert self.shape is not None and self.fingerprint is not None
            cls = ShmPushChannel if transport == "shm" else TcpPushChannel
            self._channels[key] = cls(host, port, self._token, self.fingerprint, self.stats,
                                      self._faults, self.shape, self.cfg.connect_timeout_s,
                                      tls=self._tls_client)
        return self._channels[key]

    # -- prefill side ------------------------------------------------------------------------
    def open_sends(self, meta: SplitserveMeta) -> None:
        """Before the forward pass: BEGIN the pushes whose first chunk this step computes (D's
        answer then arrives while layer 0 computes, so every layer is copied straight into
        D's region on this thread)."""
        for spec in meta.saves:
            if spec.first and spec.request_id not in self._sends:
                self._open(spec)

    def _open(self, spec: SaveSpec) -> _Send:
        assert self.shape is not None
        ch = self._channel(spec.host, spec.port, spec.transport)
        nbytes = self.shape.transfer_bytes(spec.prompt_len)
        state = ch.begin(spec.transfer_id, spec.prompt_len, nbytes, self.cfg.ack_timeout_s)
        send = self._sends[spec.request_id] = _Send(ch, state)
        return send

    def save_kv_layer(self, meta: SplitserveMeta, layer_name: str, kv_layer: torch.Tensor
                      ) -> None:
        layer = self._layers[layer_name]
        layout = self._layouts[layer]
        if not layout.holds(kv_layer):
            # on purpose not a per-transfer failure: every copy would read memory that is no
            # longer this layer's cache, so the engine must stop rather than serve
            raise RuntimeError(f"vLLM moved the KV cache of {layer_name} after registration")
        for spec in meta.saves:
            send = self._sends.get(spec.request_id)
            if send is None:
                if not spec.first:
                    continue  # its push was cancelled (preemption); nothing more to send
                send = self._open(spec)  # not opened before the forward pass
            if send.ended:
                continue
            send.channel.push_layer(LayerItem(spec.transfer_id, layer, spec.start, spec.end,
                                              layout, spec.block_ids))

    def wait_for_save(self, meta: SplitserveMeta) -> None:
        for spec in meta.saves:
            send = self._sends.get(spec.request_id)
            if spec.last and send is not None and not send.ended:
                send.channel.end(spec.transfer_id)
                send.ended = True

    def handle_preemptions(self, meta: SplitserveMeta) -> None:
        for rid in meta.cancels:
            send = self._sends.get(rid)
            if send is not None and not send.ended:
                send.channel.cancel(send.state.transfer_id)  # returns once off the blocks
                send.ended = True

    # -- decode side -------------------------------------------------------------------------
    def start_load_kv(self, meta: SplitserveMeta) -> None:
        now = time.monotonic()
        for spec in meta.loads:
            load = _Load(spec, now + self.cfg.load_timeout_s)
            if spec.sync:
                self._load_now(load)
            else:
                self._loads[spec.request_id] = load

    def _load_now(self, load: _Load) -> None:
        """A synchronous load (the transfer was complete when scheduled): copy before the forward,
        or report the blocks as failed so vLLM recomputes them (or fails the request)."""
        try:
            result = self._poll_load(load, float("inf")) if self.staging else "not_a_decode_worker"
        except Exception:
            logger.exception("KV load for %s failed", load.spec.request_id)
            result = "internal_error"
        if result != "ok":
            spec = load.spec
            bs = self._layouts[0].block_size
            self._load_errors |= set(spec.block_ids[spec.start // bs:-(-spec.end // bs)])

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _copy_into_blocks(self, st: StagedTransfer, spec: LoadSpec) -> None:
        assert self.staging is not None and self.shape is not None
        seg = self.staging.segment.tensor
        shape = self.shape
        for start in sorted(st.chunks):
            end = st.chunks[start]
            lo = max(start, spec.start)
            if lo >= end:
                continue  # D already had these tokens in its prefix cache
            nbytes = (end - start) * shape.bytes_per_token_layer
            for layer, layout in enumerate(self._layouts):
                base = st.offset + region_offset(shape, start, end, layer)
                layout.scatter(spec.block_ids, lo, end, seg[base:base + nbytes], start)

    def _poll_load(self, load: _Load, now: float) -> str | None:
        """None while waiting; "ok"; or a failure cause."""
        assert self.staging is not None
        spec = load.spec
        if load.staged is None:
            load.staged = self.staging.claim(spec.transfer_id)
        st = load.staged
        if st is None:
            final = self.staging.final_status(spec.transfer_id)
            if final is not None:
                return f"transfer_{final}"
            return "load_timeout" if now > load.deadline else None
        if st.failed:
            cause = st.failed
        elif st.complete:
            if st.num_tokens != spec.end:
                cause = "length_mismatch"
            else:
                t0 = time.perf_counter()
                self._copy_into_blocks(st, spec)
                st.record.load_s = time.perf_counter() - t0
                st.record.loaded_tokens = spec.end - spec.start
                st.record.load_mode = "sync" if spec.sync else "async"
                self.staging.release(st, "loaded")
                self.stats.close(st.record, "loaded")
                return "ok"
        elif now > load.deadline:
            cause = "load_timeout"
        else:
            return None
        self.staging.release(st, "failed")
        self.stats.close(st.record, "failed", cause)
        return cause

    def get_transfer_results(self, finished_req_ids: set[str], idle: bool = False
                             ) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if idle and self._sends and not self._loads:
            # The engine keeps stepping, computing nothing, only until D acknowledges our
            # pushes; on a worker with one core that spin would starve the sender thread and
            # the API server answering t1. Yield the core for a moment instead.
            time.sleep(IDLE_WAIT_S)
        for rid in finished_req_ids:
            send = self._sends.get(rid)
            if send is not None:
                send.finished = True
                if not send.ended:  # finished before its last layer: aborted mid-prefill
                    send.channel.cancel(send.state.transfer_id)
                    send.ended = True
        for rid, send in list(self._sends.items()):
            if send.finished:
                state = send.channel.poll(send.state.transfer_id)
                if state is None or state.settled:
                    out.finished_sending.add(rid)
                    send.channel.forget(send.state.transfer_id)
                    del self._sends[rid]
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            if self.staging is None:
                result: str | None = "not_a_decode_worker"
            elif load.spec.start == load.spec.end:  # nothing to load: release, report nothing
                st = self.staging.claim(load.spec.transfer_id)
                if st is not None:
                    self.staging.release(st, "discarded")
                    self.stats.close(st.record, "discarded")
                if (st is not None or now > load.deadline
                        or self.staging.final_status(load.spec.transfer_id) is not None):
                    del self._loads[rid]
                continue
            else:
                try:
                    result = self._poll_load(load, now)
                except Exception:  # a connector fault fails this request, never the engine
                    logger.exception("KV load for %s failed", rid)
                    result = "internal_error"
            if result is None:
                continue
            del self._loads[rid]
            out.finished_recving.add(rid)
            if result != "ok":
                out.failed_recving.add(rid)
        return out

    def shutdown(self) -> None:
        for ch in self._channels.values():
            ch.close()
        if self.listener is not None:
            self.listener.close()
        if self.staging is not None:
            self.staging.close()
