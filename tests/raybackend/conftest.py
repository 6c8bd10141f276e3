"""One Ray cluster for the Ray backend's tests: three logical nodes on 127.0.0.1 (the head with
three P slots: the shared deployment's P pool scales to 2, and a second deployment may take the
third; two nodes with one D slot each), and one deployment on it, shared by every test of this
package and torn down after its last one (the rest of the suite runs without them).

The cluster's environment is set by the `ray_cluster` fixture for the cluster's lifetime and
restored after it: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (read when `ray` is first imported)
keeps every node's address on loopback, and each node is also started with `node_ip_address`
127.0.0.1. Ray's memory monitor is off for this cluster (`_system_config`): it kills Ray
workers, the Serve controller included, when the whole machine nears its memory limit, whoever
holds the memory, and the suite shares the machine with its own vLLM workers. `ray start` /
`ray stop` are never used: `ray stop` would stop every Ray process on the machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from splitserve.launch.config import DeploymentConfig, from_mapping
from splitserve.worker.launch import free_port
from tests.support.integration import starts_processes
from tests.support.workers import LOG_DIR

LOOPBACK = "127.0.0.1"
CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SYSTEM_CONFIG = {
    # a lost node is declared dead within seconds (Ray's default is up to ~50 s)
    "health_check_period_ms": 1000, "health_check_timeout_ms": 3000,
    "health_check_failure_threshold": 4,
    "memory_monitor_refresh_ms": 0,
}


@dataclass
class RayCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    decode_nodes: list[Any] = field(default_factory=list)

    def add_decode_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=4, resources={"decode_node": 1},
                                     node_ip_address=LOOPBACK)
        self.decode_nodes.append(node)
        return node


@pytest.fixture(scope="package")
@starts_processes
def ray_cluster() -> Iterator[RayCluster]:
    saved = {k: os.environ.get(k) for k in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"prefill_node": 3}, "include_dashboard": False,
            "node_ip_address": LOOPBACK, "_system_config": SYSTEM_CONFIG})
        rc = RayCluster(cluster)
        rc.add_decode_node()
        rc.add_decode_node()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="splitserve", log_to_driver=False,
                 _node_ip_address=LOOPBACK)
        yield rc
    finally:
        ray.shutdown()
        if cluster is not None:  # every node at once: nothing of the deployment is left to drain
            for node in [*cluster.worker_nodes, cluster.head_node]:
                cluster.remove_node(node, allow_graceful=False)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ray_config(model: Path, address: str) -> DeploymentConfig:
    """1P+1D, each pool autoscaling to 2 on its own signal (low thresholds: a test's load)."""
    return from_mapping(ray_mapping(model, address))


def ray_mapping(model: Path, address: str) -> dict[str, Any]:
    """`ray_config`'s mapping, for tests that deploy a variant of it."""
    return {
        "backend": "ray", "ray_address": address, "model": str(model), "prefill": 1,
        "decode": 1, "port": free_port(), "max_model_len": 1024, "stop_timeout_s": 10,
        "log_dir": str(LOG_DIR / "ray"),
        # these tests repeat prompts (streamed and not; the scaling load) and count split
        # requests and P's queue: routing by cache and prefill on D would take repeats off P
        # (tests/router/test_cache_e2e.py covers those; the router is the same on Ray)
        "router": {"prefill_policy": "load", "decode_policy": "load",
                   "local_prefill_max_tokens": 0},
        # P scales on the prompt tokens it still has to compute: with the workers' cache known
        # to the router, the scaling load's four repeated prompts would leave P nothing queued
        # after their first round, so these workers do not report their cache
        "kv_events": False,
        "ray": {"prefill_resources": {"prefill_node": 1},
                "decode_resources": {"decode_node": 1},
                "prefill_max": 2, "decode_max": 2, "prefill_queued_tokens": 60,
                # one stream on 2 Ds needs 0.5 of one: below 0.6 it drains back to 1 (at
                # 0.5 it would sit on the boundary and hold 2 whenever the stream is mostly on D)
                "decode_running": 2, "downscale_below": 0.6,
                "upscale_delay_s": 0.5, "downscale_delay_s": 15,
                "look_back_period_s": 2, "drain_timeout_s": 20}}


@pytest.fixture(scope="package")
def ray_deployment(ray_cluster: RayCluster, llama_ckpt: Path) -> Iterator[Any]:
    from splitserve.launch.raybackend.deployment import RayDeployment

    dep = RayDeployment(ray_config(llama_ckpt, ray_cluster.cluster.address),
                        say=lambda line: print(line, flush=True))
    dep.start()
    try:
        yield dep
    finally:
        dep.stop()
