"""splitserve's vLLM KV connector (`kv_connector_module_path: splitserve.connector.vllm`).

One class, two roles, as vLLM instantiates it: in the scheduler (EngineCore) process it delegates
to `SchedulerSide`; in the worker process to `WorkerSide`. Settings come from
`kv_connector_extra_config["splitserve"]` (see `ConnectorConfig`); the deployment token from the
environment. What crosses between the two processes is `SplitserveMeta` (scheduler -> worker)
and vLLM's `KVConnectorOutput` (worker -> scheduler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput

from splitserve.common.vocab import Role
from splitserve.config import ConnectorConfig
from splitserve.connector.donetable import table_path
from splitserve.connector.layout.paged import EngineKV
from splitserve.connector.meta import SplitserveMeta
from splitserve.connector.ranks import RankHeads
from splitserve.connector.scheduler_side import SchedulerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def rank_heads(vllm_config: VllmConfig, rank: int) -> RankHeads:
    """Tensor-parallel rank `rank`'s place among the model's KV heads."""
    mc = vllm_config.model_config
    latent = bool(mc.use_mla)
    return RankHeads(1 if latent else mc.get_total_num_kv_heads(),
                     vllm_config.parallel_config.tensor_parallel_size, rank, latent)


class SplitserveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra_config(tc.kv_connector_extra_config)
        self._sched: SchedulerSide | None = None
        self._worker = None
        tp = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                self.cfg.transport, [table_path(str(tc.engine_id), r) for r in range(tp)],
                rank_heads(vllm_config, 0))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from splitserve.common.engine import installed_vllm_version
            from splitserve.connector.worker_side import WorkerSide

            mc = vllm_config.model_config
            rank = get_tensor_model_parallel_rank() if tp > 1 else 0
            self._worker = WorkerSide(self.cfg, str(tc.engine_id), mc.hf_config.to_dict(),
                                      mc.dtype, installed_vllm_version() or "unknown",
                                      heads=rank_heads(vllm_config, rank))

    @property
    def requires_kv_delivery(self) -> bool:
        return self.cfg.role in (Role.PREFILL, Role.BOTH)

    def _meta(self) -> SplitserveMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SplitserveMeta)
        return meta

    # -- worker side -------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before every forward pass (vLLM's contract): also open this step's new pushes, so D
        has answered BEGIN by the time the first layer's KV is ready to copy."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, SplitserveMeta):
            self._worker.open_sends(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self._engine_kv(kv_caches))

    def _engine_kv(self, kv_caches: dict[str, torch.Tensor]) -> EngineKV:
        """The engine's facts about its KV cache, from which the paged layout is chosen."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        cfg = self._vllm_config
        kcc = self._kv_cache_config
        layout = cfg.cache_config.kv_cache_layout or (kcc.kv_cache_layout if kcc else None)
        first = next(iter(kv_caches.values()), None)
        return EngineKV(
            device=first.device.type if first is not None else "cpu",
            backends=tuple(b.get_name() for b in get_current_attn_backends(cfg)),
            cache_layout=layout, use_mla=bool(cfg.model_config.use_mla),
            spec_kinds=tuple(sorted({type(g.kv_cache_spec).__name__
                                     for g in (kcc.kv_cache_groups if kcc else [])})),
            kv_cache_groups=len(kcc.kv_cache_groups) if kcc else 1,
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, SplitserveMeta):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before a request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._meta()
        if meta.saves:
            self._worker.save_kv_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        idle = self.has_connector_metadata() and self._meta().idle
        return self._worker.get_transfer_results(finished_req_ids, idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side ----------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        assert self._sched is not None
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))
