"""The Ray backend's scale timeline: replicas per pool over time against a stepped load, on a
Ray cluster of three logical nodes on 127.0.0.1 (the head with two P slots, two nodes with one
D slot each), each pool autoscaling 1..2 on its own signal. Printed and written to JSON (one
point per half second: concurrency, routable P and D replicas, requests finished), never
asserted.

    python benchmarks/ray_scale.py [--model DIR] [--steps 1:10,4:10,2:100,1:40,0:30]

`--steps` is concurrency:seconds, in order. The model defaults to a tiny generated Llama.
Each point also has Serve's own replica states per pool (STARTING: a step in progress).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray: every node on 127.0.0.1
LOOPBACK = "127.0.0.1"

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_json  # noqa: E402

from splitserve.demo_model import ModelSpec, build_checkpoint  # noqa: E402
from splitserve.launch.config import from_mapping  # noqa: E402
from splitserve.worker.launch import free_port  # noqa: E402

TINY = ModelSpec(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, seed=7)


class Clients:
    """Closed-loop streaming clients; `want` of them run at a time."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.want = url, model, 0
        self.done = {"ok": 0, "error": 0}
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def set(self, n: int) -> None:
        self.want = n
        while len(self.threads) < n:
            t = threading.Thread(target=self.run, args=(len(self.threads),), daemon=True)
            self.threads.append(t)
            t.start()

    def run(self, i: int) -> None:
        body = {"model": self.model, "prompt": [3 + (i * 37 + j * 13) % 1000 for j in range(300)],
                "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                if i >= self.want:
                    time.sleep(0.1)
                    continue
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        text = "".join(r.iter_lines()) if r.status_code == 200 else "error"
                    self.done["ok" if text.endswith("[DONE]") and '"error"' not in text
                              else "error"] += 1
                except httpx.HTTPError:
                    self.done["error"] += 1


def serve_states(cfg: Any) -> dict[str, dict[str, int]]:
    """Serve's replica states per pool (RUNNING, STARTING, STOPPING: how many of each)."""
    from ray import serve

    apps = serve.status().applications
    out = {}
    for kind in ("prefill", "decode"):
        app = apps.get(f"{cfg.ray.name}-{kind}")
        states = app.deployments[kind].replica_states if app else {}
        out[kind] = {str(getattr(k, "value", k)): n for k, n in states.items()}
    return out


def changes(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points where the load, a pool's routable replicas or Serve's states changed."""
    out, last = [], None
    for p in points:
        key = (p["concurrency"], p["prefill"], p["decode"], str(p["serve"]))
        if key != last:
            out.append(p)
        last = key
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", default="1:10,4:10,2:100,1:40,0:30")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ray_scale.json"))
    args = ap.parse_args()
    steps = [(int(c), float(s)) for c, s in (x.split(":") for x in args.steps.split(","))]
    model = args.model or str(build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", TINY))

    import ray
    from ray.cluster_utils import Cluster

    from splitserve.launch.raybackend.deployment import RayDeployment

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"prefill_node": 2}, "include_dashboard": False,
        "node_ip_address": LOOPBACK,
        # Ray's memory monitor would kill replicas when other jobs fill the shared machine
        "_system_config": {"memory_monitor_refresh_ms": 0}})
    for _ in range(2):
        cluster.add_node(num_cpus=4, resources={"decode_node": 1}, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="splitserve", log_to_driver=False,
             _node_ip_address=LOOPBACK)
    cfg = from_mapping({
        "backend": "ray", "ray_address": cluster.address, "model": model, "prefill": 1,
        "decode": 1, "port": free_port(), "max_model_len": 1024, "stop_timeout_s": 10,
        "ray": {"prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1},
                "prefill_max": 2, "decode_max": 2, "prefill_queued_tokens": 100,
                "decode_running": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 15,
                "look_back_period_s": 2, "drain_timeout_s": 20}})
    dep = RayDeployment(cfg, say=lambda line: print(line, flush=True))
    points: list[dict[str, Any]] = []
    try:
        url = dep.start()
        clients = Clients(url, httpx.get(f"{url}/v1/models").json()["data"][0]["id"])
        t0 = time.monotonic()
        for concurrency, seconds in steps:
            clients.set(concurrency)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                counts = {"prefill": 0, "decode": 0}
                for w in dep.workers():
                    counts[w["kind"]] += not w["draining"]
                points.append({"t": round(time.monotonic() - t0, 1), "concurrency": concurrency,
                               **counts, **clients.done, "serve": serve_states(cfg)})
                print(points[-1], flush=True)
                time.sleep(0.5)
        clients.stop.set()
    finally:
        dep.stop()
        ray.shutdown()
        cluster.shutdown()
    print(f"\n{'t (s)':>7} {'streams':>7} {'P':>2} {'D':>2}  done ok/error  Serve (P | D)")
    for p in changes(points):
        print(f"{p['t']:7.1f} {p['concurrency']:7d} {p['prefill']:2d} {p['decode']:2d}  "
              f"{p['ok']:5d}/{p['error']:<5d}  {p['serve']['prefill']} | {p['serve']['decode']}")
    write_json(args.out, {"steps": steps, "model": model, "points": points,
                          "config": {"prefill": "1..2, 100 queued prompt tokens per replica",
                                     "decode": "1..2, 2 running requests per replica"}})


if __name__ == "__main__":
    main()
