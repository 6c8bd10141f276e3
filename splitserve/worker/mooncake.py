"""vLLM's MooncakeConnector as splitserve's workers run it: the same connector, loaded from this
module under the same class name (so vLLM's `has_connector` checks and peers see vLLM's).

One CPU fact: the connector's worker side asks `torch.accelerator.current_device_index()` while
it is built, and CPU torch raises there (no accelerator). On a machine without one, that call is
answered 0 for the duration of the constructor (the index is then only handed to
`torch.cpu.set_device`, which accepts it); with an accelerator nothing is changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector as VllmMooncakeConnector,
)


@contextlib.contextmanager
def device_index_without_accelerator() -> Iterator[None]:
    """While open, `torch.accelerator.current_device_index()` answers 0 when no accelerator
    exists; unchanged otherwise. Restored on exit."""
    if torch.accelerator.is_available():
        yield
        return
    accelerator = torch.accelerator
    original = accelerator.current_device_index
    accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        accelerator.current_device_index = original


class MooncakeConnector(VllmMooncakeConnector):
    """vLLM's MooncakeConnector; its worker side is built with the device index answered on a
    machine without an accelerator (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        with device_index_without_accelerator():
            super().__init__(vllm_config, role, kv_cache_config)
