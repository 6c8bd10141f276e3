"""vLLM's NixlConnector as splitserve's workers run it: the same connector, with two CPU facts
handled through vLLM's supported `kv_connector_module_path` hook.

vLLM loads `NixlConnector` from this module when a worker's `--kv-transfer-config` names it
(`splitserve.worker.kv_transfer.kv_transfer_config`). The class *is* vLLM's connector (a
subclass with the same name, so every `has_connector("NixlConnector")` check in vLLM still
holds, and peers, proxies and vllm-router see the stock protocol). Only the worker-side
constructor differs:

- **Progress thread delay.** nixl's Python API builds every agent with `pthrDelay = 0`, so UCX's
  progress thread busy-spins a whole core even when idle, and vLLM exposes no setting for it.
  While vLLM builds its agent, the binding's `nixlAgent` constructor is wrapped so the agent gets
  `progress_delay_us` instead (the thread's poll timeout: it still wakes on UCX events, and
  otherwise every `progress_delay_us`). The thread stays on, so D's pulls never wait for P's
  forward step (with the thread off they wait for P's whole prefill step).
- **Core affinity.** On CPU, `NixlConnectorWorker.__init__` moves the calling thread (the one
  that runs the forward pass) onto the last core of each NUMA node, which puts every worker of a
  machine on the same core. The thread's affinity from before the constructor (the worker's
  `--cpus`, as vLLM's OpenMP binding left it) is restored after it.

Both are read from `kv_connector_extra_config["splitserve_nixl"]` (see `NixlTuning`); the
scheduler-side connector is vLLM's, unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as VllmNixlConnector,
)

from splitserve.worker.nixl_tuning import NixlTuning


@contextlib.contextmanager
def progress_delay(delay_us: int) -> Iterator[None]:
    """While open, every NIXL agent built through nixl's Python API gets a progress-thread
    delay of `delay_us` microseconds. The binding's constructor is restored on exit."""
    from vllm.distributed.nixl_utils import NixlWrapper

    api = importlib.import_module(NixlWrapper.__module__)  # the nixl._api that builds agents
    binding = api.nixlBind
    build = binding.nixlAgent

    def build_with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return build(name, config)

    binding.nixlAgent = build_with_delay
    try:
        yield
    finally:
        binding.nixlAgent = build


class NixlConnector(VllmNixlConnector):
    """vLLM's NixlConnector (pull mode); on the worker side its agent's progress thread polls
    with `NixlTuning.progress_delay_us` and the forward thread keeps its cores."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        if role != KVConnectorRole.WORKER:
            super().__init__(vllm_config, role, kv_cache_config)
            return
        tuning = NixlTuning.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        cores = os.sched_getaffinity(0)
        with progress_delay(tuning.progress_delay_us):
            super().__init__(vllm_config, role, kv_cache_config)
        if tuning.keep_affinity:
            os.sched_setaffinity(0, cores)
