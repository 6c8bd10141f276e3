"""A worker running vLLM's MooncakeConnector as `--connector mooncake` starts it: its
`--kv-transfer-config` and environment, its settings, its info, and the device-index answer on a
machine without an accelerator. Real Mooncake workers are in tests/mooncakeconnector."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from splitserve.config import WorkerConfig
from splitserve.worker.kv_transfer import check_mooncake_installed
from splitserve.worker.launch import worker_command
from splitserve.worker.mooncake_settings import MooncakeSettings, default_protocol
from splitserve.worker.plugin import mooncake_info
from tests.support.workers import TOKEN


def test_a_mooncake_worker_runs_vllms_connector_with_its_bootstrap_port_and_lease() -> None:
    cfg = WorkerConfig(model="m", port=8000, role="prefill", kv_port=9123, connector="mooncake",
                       lease_s=25.0, cpus=(0,), mooncake_protocol="tcp")
    argv, env = worker_command(cfg, TOKEN)
    kv_config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv_config["kv_connector"] == "MooncakeConnector" and kv_config["kv_role"] == "kv_both"
    assert kv_config["kv_connector_module_path"] == "splitserve.worker.mooncake"
    assert kv_config["kv_load_failure_policy"] == "recompute"
    extra = kv_config["kv_connector_extra_config"]
    assert extra["mooncake_protocol"] == "tcp"
    assert extra["splitserve_mooncake"] == {"role": "prefill", "protocol": "tcp",
                                            "bootstrap_port": 9123}
    assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "9123"
    assert env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] == "25"
    assert TOKEN not in json.dumps(kv_config)

    info = mooncake_info(Namespace(kv_transfer_config=json.dumps(kv_config), host="127.0.0.1"))
    assert info is not None and info.connector == "mooncake" and info.role == "prefill"
    assert (info.kv_host, info.kv_port, info.transport) == ("127.0.0.1", 9123, "tcp")
    assert mooncake_info(Namespace(kv_transfer_config=None)) is None


def test_mooncake_settings_are_validated(tmp_path: Path) -> None:
    for bad in ({"protocol": "udp"}, {"role": "middle"}, {"bootstrap_port": 0}):
        with pytest.raises(ValueError):
            MooncakeSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mooncake_protocol"):
        WorkerConfig(model="m", port=8000, role="decode", kv_port=9000, connector="mooncake",
                     mooncake_protocol="ib")
    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    with pytest.raises(ValueError, match="Mooncake's bootstrap server and transfers are not"):
        WorkerConfig(model="m", port=8000, role="decode", kv_port=9000, connector="mooncake",
                     kv_tls_cert=str(tmp_path / "c.pem"), kv_tls_key=str(tmp_path / "k.pem"))


def test_the_protocol_is_rdma_only_where_an_rdma_device_is(tmp_path: Path) -> None:
    assert default_protocol(str(tmp_path / "absent")) == "tcp"
    assert default_protocol(str(tmp_path)) == "tcp"  # the class exists, with no device
    (tmp_path / "mlx5_0").mkdir()
    assert default_protocol(str(tmp_path)) == "rdma"


def test_the_device_index_is_answered_only_without_an_accelerator() -> None:
    from splitserve.worker.mooncake import MooncakeConnector, device_index_without_accelerator

    assert MooncakeConnector.__name__ == "MooncakeConnector"  # vLLM checks connectors by name
    original = torch.accelerator.current_device_index
    with device_index_without_accelerator():
        assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_device_index is original
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError):
            torch.accelerator.current_device_index()


def test_mooncakes_engine_loads_here() -> None:
    check_mooncake_installed()  # the `mooncake` extra and libibverbs, as `make install` sets up
