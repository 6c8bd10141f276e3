"""vLLM's worker side of the connector (the process that owns the KV cache).

At registration it chooses and verifies the paged layout (`layout.select`), then builds what
each role needs: P's pushes (`prefill_send.PrefillSends`), D's staging area and loads
(`decode_load`), and the listener that receives pushes and answers control queries
(`control.ControlAnswers`). Every later call of vLLM's is handed to the part it concerns.

Copies between the engine's blocks and host bytes go through one `Copier` (`devcopy`), chosen
from the caches' device: on a CPU engine the synchronous copies; on a CUDA engine P's are
queued on a side stream (the sender waits for them) and D's copy into the blocks runs on it
while the engine steps, the request reported ready (and its staged bytes freed) once that copy
has completed. D's staging segment is registered as pinned memory where the driver allows it.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from splitserve.common.vocab import Role
from splitserve.config import ConnectorConfig, load_token
from splitserve.connector.control import ControlAnswers
from splitserve.connector.decode_load import DecodeLoads, open_staging
from splitserve.connector.devcopy import Copier, CudaCopies, InlineCopies
from splitserve.connector.faults import Faults
from splitserve.connector.layout.paged import EngineKV, kv_shape
from splitserve.connector.layout.select import select_layouts
from splitserve.connector.layout.staging_format import KVShape
from splitserve.connector.listener import KVListener
from splitserve.connector.meta import SplitserveMeta
from splitserve.connector.prefill_send import PrefillSends
from splitserve.connector.protocol import Fingerprint, config_hash
from splitserve.connector.ranks import RankHeads
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.tls import client_context, server_context

logger = init_logger(__name__)
IDLE_WAIT_S = 0.001  # per empty engine step while pushes await D's acknowledgement


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[0]) if found else 0


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, hf_config: dict[str, Any],
                 dtype: torch.dtype, vllm_version: str, copier: Copier | None = None,
                 heads: RankHeads | None = None) -> None:
        """`copier`: how copies between the blocks and host bytes run; None: chosen from the
        caches' device at registration (`CudaCopies` on CUDA, `InlineCopies` otherwise).
        `heads`: this tensor-parallel rank's place among the model's KV heads (None: a single
        rank holding them all); rank r listens on `kv_port + r`."""
        self.cfg = cfg
        self._heads = heads
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
        self._copier: Copier = copier or InlineCopies()
        self._copier_given = copier is not None
        self.shape: KVShape | None = None
        self.fingerprint: Fingerprint | None = None
        self.staging: StagingArea | None = None
        self.listener: KVListener | None = None
        self._sends: PrefillSends | None = None
        self._loads: DecodeLoads | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], engine: EngineKV) -> None:
        """Choose and verify the paged layout (refusing a cache no layout reads), then open
        the listener (and, on D, the staging area)."""
        names = sorted(kv_caches, key=_layer_index)
        layers = {n: i for i, n in enumerate(names)}
        layouts = select_layouts([(n, kv_caches[n]) for n in names], engine)
        device = kv_caches[names[0]].device
        if device.type == "cuda" and not self._copier_given:
            self._copier = CudaCopies(device)
        first = layouts[0]
        shape = self.shape = kv_shape(layouts)
        heads, head_dim = shape.num_kv_heads, shape.head_dim
        rank = self._heads or RankHeads.single(heads, shape.latent)
        if rank.held[1] - rank.held[0] != heads:
            raise RuntimeError(f"rank {rank.rank} of tp {rank.tp} holds {heads} KV heads, "
                               f"not the {rank.held} splitserve expects")
        port = self.cfg.kv_port + rank.rank if self.cfg.kv_port else 0
        logger.info("splitserve connector: role=%s transport=%s kv=%s:%d tls=%s layout=%s "
                    "layers=%d kv_heads=%d head_dim=%d block_size=%d dtype=%s rank=%d/%d",
                    self.cfg.role, self.cfg.transport, self.cfg.kv_host, port,
                    ("mutual" if self.cfg.tls_ca else "on") if self.cfg.tls_enabled else "off",
                    first.name, len(names), heads, head_dim, first.block_size, first.dtype,
                    rank.rank, rank.tp)
        fingerprint = self.fingerprint = Fingerprint(
            config_hash=config_hash(self._hf_config), dtype=str(self._dtype).replace("torch.", ""),
            num_layers=len(names), num_kv_heads=rank.total, head_dim=head_dim,
            vllm_version=self._vllm_version, tp_size=rank.tp, tp_rank=rank.rank,
            latent=shape.latent,
        )
        if self.cfg.role in (Role.DECODE, Role.BOTH):
            self.staging = open_staging(self.cfg, self.engine_id, shape, self.stats, rank)
            self._copier.register_host(self.staging.segment.tensor)
        sends = self._sends = PrefillSends(self.cfg, self._token, self._tls_client, self._faults,
                                           self.stats, layers, layouts, shape, fingerprint,
                                           copier=self._copier, heads=rank)
        loads = self._loads = DecodeLoads(self.cfg, self.staging, self.stats, layouts, shape,
                                          self._copier)
        control = ControlAnswers(self.cfg, self.engine_id, self._vllm_version, fingerprint,
                                 self.stats, self.staging, lambda: loads.pending,
                                 lambda: sends.held)
        self.listener = KVListener(self.cfg.kv_host, port, self._token,
                                   fingerprint, self.staging, control.answer, self._tls_server,
                                   self._faults)

    # -- prefill side: PrefillSends ----------------------------------------------------------
    def open_sends(self, meta: SplitserveMeta) -> None:
        if self._sends is not None:
            self._sends.open_sends(meta)

    def save_kv_layer(self, meta: SplitserveMeta, layer_name: str, kv_layer: torch.Tensor
                      ) -> None:
        assert self._sends is not None
        self._sends.save_kv_layer(meta, layer_name, kv_layer)

    def wait_for_save(self, meta: SplitserveMeta) -> None:
        if self._sends is not None:
            self._sends.wait_for_save(meta)

    def handle_preemptions(self, meta: SplitserveMeta) -> None:
        if self._sends is not None:
            self._sends.handle_preemptions(meta)

    # -- decode side: DecodeLoads ------------------------------------------------------------
    def start_load_kv(self, meta: SplitserveMeta) -> None:
        assert self._loads is not None
        self._loads.start(meta)

    def take_load_errors(self) -> set[int]:
        return self._loads.take_load_errors() if self._loads is not None else set()

    # -- every step --------------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str], idle: bool = False
                             ) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self._sends is None or self._loads is None:
            return out
        if idle and not self._loads.pending:
            # The engine keeps stepping, computing nothing, only until D acknowledges the
            # pushes of some rank (this one's, or, with tensor parallelism, another's: the
            # ranks step together); on a worker with one core a rank a spin would starve the
            # sender thread, the API server answering t1, and whatever shares the core.
            # Yield the core for a moment instead.
            time.sleep(IDLE_WAIT_S)
        out.finished_sending |= self._sends.finished_sending(finished_req_ids)
        loaded = self._loads.poll()
        out.finished_recving |= loaded.finished
        out.failed_recving |= loaded.failed
        return out

    def shutdown(self) -> None:
        if self._sends is not None:
            self._sends.close()
        if self.listener is not None:
            self.listener.close()
        if self.staging is not None:
            self._copier.unregister_host(self.staging.segment.tensor)
            self.staging.close()
