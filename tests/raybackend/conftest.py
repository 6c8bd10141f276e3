"""One Ray cluster for the Ray backend's tests: three logical nodes on 127.0.0.1 (the head
with the P pool's resource, two nodes with one D slot each), and one deployment on it, shared by
the tests of a module and torn down after it (the rest of the suite runs without them).

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` before `import ray` keeps every node's address on
loopback (without it Ray advertises the machine's interface address). `ray start`/`ray stop`
are never used: `ray stop` would stop every Ray process on the machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray's memory monitor kills Ray workers (the Serve controller included) when the whole machine
# nears its memory limit, whoever holds the memory; the suite shares the machine with its own
# vLLM workers, so the monitor stays off for this cluster.
os.environ["RAY_memory_monitor_refresh_ms"] = "0"

from workers import LOG_DIR  # noqa: E402

from splitserve.launch.config import DeploymentConfig, from_mapping  # noqa: E402
from splitserve.worker.launch import free_port  # noqa: E402


@dataclass
class RayCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    decode_nodes: list[Any] = field(default_factory=list)

    def add_decode_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=4, resources={"decode_node": 1})
        self.decode_nodes.append(node)
        return node


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"prefill_node": 2}, "include_dashboard": False,
        # a lost node is declared dead within seconds (Ray's default is up to ~50 s)
        "_system_config": {"health_check_period_ms": 1000, "health_check_timeout_ms": 3000,
                           "health_check_failure_threshold": 4}})
    rc = RayCluster(cluster)
    try:
        rc.add_decode_node()
        rc.add_decode_node()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="splitserve", log_to_driver=False)
        yield rc
    finally:
        ray.shutdown()
        cluster.shutdown()


def ray_config(model: Path, address: str) -> DeploymentConfig:
    """1P+1D, each pool autoscaling to 2 on its own signal (low thresholds: a test's load)."""
    return from_mapping({
        "backend": "ray", "ray_address": address, "model": str(model), "prefill": 1,
        "decode": 1, "port": free_port(), "max_model_len": 1024, "stop_timeout_s": 10,
        "log_dir": str(LOG_DIR / "ray"),
        "ray": {"prefill_resources": {"prefill_node": 1},
                "decode_resources": {"decode_node": 1},
                "prefill_max": 2, "decode_max": 2, "prefill_queued_tokens": 60,
                "decode_running": 1.5, "upscale_delay_s": 0.5, "downscale_delay_s": 5,
                "look_back_period_s": 2, "drain_timeout_s": 20}})


@pytest.fixture(scope="module")
def ray_deployment(ray_cluster: RayCluster, llama_ckpt: Path) -> Iterator[Any]:
    from splitserve.launch.raybackend.deployment import RayDeployment

    dep = RayDeployment(ray_config(llama_ckpt, ray_cluster.cluster.address),
                        say=lambda line: print(line, flush=True))
    dep.start()
    yield dep
    dep.stop()
