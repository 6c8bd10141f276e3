"""1P+1D on different logical Ray nodes, through the router, KV over tcp: greedy float32 output
equals Hugging Face transformers; the router's workers are the ones Ray placed, each shown with
its Ray node (in `/workers` and the per-worker Prometheus families); the token is on no command
line; every TCP connection of the cluster's processes (`ss -tnp`) is on loopback.

And 1P+1D over vLLM's NixlConnector, then over its MooncakeConnector, on the same cluster (a
second deployment each, on the P slot and the D node the first leaves free, stopped before the
scaling test needs them), behind two router replicas that know each other as peers: D loads
P's blocks across the Ray nodes and computes no prompt token, token-exact through either
router, each following both workers' cache reports."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve.config import bearer_headers
from splitserve.launch.config import from_mapping
from splitserve.worker.launch import free_port
from splitserve.worker.mooncake_settings import default_protocol
from tests.support.rayload import (
    cmdlines,
    complete,
    descendants,
    metric,
    off_loopback_connections,
    prompt_of,
)
from tests.support.workers import hf_greedy

from .conftest import ray_mapping

MAX_TOKENS = 10


def test_1p1d_on_two_ray_nodes_matches_transformers(ray_deployment: Any, llama_ckpt: Path
                                                    ) -> None:
    dep = ray_deployment
    placed = {w["kind"]: w for w in dep.workers()}
    assert set(placed) == {"prefill", "decode"}
    assert placed["prefill"]["node_id"] != placed["decode"]["node_id"]
    deadline = time.monotonic() + 10  # the router host labels the first workers in a round
    while True:
        routed = httpx.get(f"{dep.url}/workers", timeout=10).json()["workers"]
        if all(w["node"] for w in routed) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {(w["role"], w["url"], w["node"]) for w in routed} == {
        (k, w["url"], w["node_id"]) for k, w in placed.items()}
    assert all(w["kv_endpoint"]["transport"] == "tcp" for w in routed)
    before = httpx.get(f"{dep.url}/metrics", timeout=5).text
    for i, length in enumerate((9, 130, 400)):
        prompt = prompt_of(length, i)
        want = hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
        assert complete(dep.url, prompt, MAX_TOKENS, stream=False) == want
        assert complete(dep.url, prompt, MAX_TOKENS, stream=True) == want
    metrics = httpx.get(f"{dep.url}/metrics", timeout=5).text
    def grew(*name: str) -> float:
        return metric(metrics, *name) - metric(before, *name)

    assert grew("splitserve_router_requests_total", 'mode="split"', 'outcome="ok"') == 6
    # every request's KV went from P to D over tcp, and D holds none of it afterwards
    assert grew("splitserve_router_kv_bytes_count") == 6
    assert grew("splitserve_router_kv_bytes_sum") > 0
    d_state = httpx.get(f"{placed['decode']['url']}/splitserve/state",
                        headers=bearer_headers(dep.token), timeout=5).json()
    assert d_state["staged_bytes"] == 0
    node = placed["decode"]["node_id"]
    assert metric(metrics, "splitserve_router_worker_routable", 'role="decode"',
                  f'node="{node}"') == 1
    assert not any(dep.token in c for c in cmdlines())
    # every connection of the cluster, its replicas, workers and router stays on loopback
    ours = descendants(os.getpid())
    assert len(ours) > 10
    assert off_loopback_connections(ours | {os.getpid()}) == []


def test_a_start_that_cannot_finish_fails_and_leaves_the_running_deployment_serving(
        ray_deployment: Any, ray_cluster: Any, llama_ckpt: Path) -> None:
    """A second deployment of the running one's name fails at once, naming it (in its
    namespace or another); one whose replicas no node can place fails at `startup_timeout_s`,
    naming its pool, without waiting on replicas that never ran. Either ends
    having deleted only what it deployed: the running deployment serves on, token-exact."""
    from ray import serve

    from splitserve.launch.raybackend.deployment import RayDeployment

    dep = ray_deployment
    lines: list[str] = []
    same_name = RayDeployment(dep.cfg, say=lines.append)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="named 'splitserve' already runs"):
        same_name.start()
    mapping = ray_mapping(llama_ckpt, ray_cluster.cluster.address)
    # Serve's application names are the cluster's: another namespace does not free them
    other_namespace = mapping | {"ray": mapping["ray"] | {"namespace": "elsewhere"}}
    with pytest.raises(RuntimeError, match="already runs splitserve-decode, splitserve-prefill"):
        RayDeployment(from_mapping(other_namespace), say=lines.append).start()
    assert time.monotonic() - t0 < 20 and lines == []
    mapping["ray"] = mapping["ray"] | {"name": "unplaceable",
                                       "prefill_resources": {"no_such_node": 1},
                                       "decode_resources": {"no_such_node": 1}}
    unplaceable = RayDeployment(from_mapping(mapping | {"startup_timeout_s": 6}),
                                say=lines.append)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="unplaceable-prefill: .*unplaceable-decode: "):
        unplaceable.start()
    # its replicas never ran: Serve is not left to wait out their graceful shutdown (70 s)
    assert time.monotonic() - t0 < 6 + 30
    assert not {"unplaceable-prefill", "unplaceable-decode"} & set(serve.status().applications)
    assert {w["kind"] for w in dep.workers()} == {"prefill", "decode"}
    prompt = prompt_of(20, 5)
    assert complete(dep.url, prompt, MAX_TOKENS, stream=False) == hf_greedy(
        llama_ckpt, prompt, MAX_TOKENS)


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_1p1d_over_vllms_connector_across_ray_nodes_matches_transformers(
        ray_deployment: Any, ray_cluster: Any, llama_ckpt: Path, connector: str) -> None:
    from splitserve.launch.raybackend.deployment import RayDeployment

    mapping = ray_mapping(llama_ckpt, ray_cluster.cluster.address)
    # cache-aware, as deployed by default: each router follows both workers' cache reports
    mapping |= {"connector": connector, "port": free_port(count=2), "routers": 2,
                "kv_events": True}
    del mapping["router"]
    mapping["ray"] = {k: v for k, v in mapping["ray"].items() if not k.endswith("_max")}
    mapping["ray"]["name"] = connector
    dep = RayDeployment(from_mapping(mapping), say=lambda line: print(line, flush=True))
    dep.start()
    try:
        placed = {w["kind"]: w for w in dep.workers()}
        assert placed["prefill"]["node_id"] != placed["decode"]["node_id"]
        routed = httpx.get(f"{dep.url}/workers", timeout=10).json()["workers"]
        # NIXL's endpoint names NIXL; Mooncake's names its protocol (tcp without an RDMA device)
        assert {w["kv_endpoint"]["transport"] for w in routed} == \
            {{"nixl": "nixl", "mooncake": default_protocol()}[connector]}
        assert len(dep.urls) == 2
        deadline = time.monotonic() + 10  # each router host sets its peers in its next round
        for front, peer in (dep.urls, dep.urls[::-1]):
            while True:
                view = httpx.get(f"{front}/workers", timeout=10).json()
                if [p["url"] for p in view["peers"]] == [peer] and all(
                        (w["cache"] or {}).get("synced") for w in view["workers"]):
                    break
                assert time.monotonic() < deadline, view
                time.sleep(0.2)
        d_metrics = f"{placed['decode']['url']}/metrics"

        def d_prompt_tokens(source: str) -> float:
            text = httpx.get(d_metrics, headers=bearer_headers(dep.token), timeout=5).text
            return metric(text, "vllm:prompt_tokens_by_source_total", f'source="{source}"')

        for i, length in enumerate((130, 400)):
            prompt = prompt_of(length, 20 + i)
            want = hf_greedy(llama_ckpt, prompt, MAX_TOKENS)
            computed, loaded = d_prompt_tokens("local_compute"), \
                d_prompt_tokens("external_kv_transfer")
            assert complete(dep.urls[i], prompt, MAX_TOKENS, stream=True) == want
            # a new prompt's blocks came from P: D computed none of its tokens
            assert d_prompt_tokens("local_compute") == computed
            assert d_prompt_tokens("external_kv_transfer") > loaded
            assert complete(dep.urls[1 - i], prompt, MAX_TOKENS, stream=False) == want
    finally:
        dep.stop()
