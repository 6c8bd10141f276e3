"""The pools autoscale apart under a rate ramp, survive the loss of a D node at the peak, and
scale down after it, on the package's Ray cluster of logical nodes:

- low load: 1P+1D; a ramp to 4 concurrent streams: P scales to 2 on queued prompt tokens and D
  to 2 on running requests (the most each policy may ask for), one replica at a time (Serve
  never has two replicas of a pool starting at once); the load drops to one stream while the
  new replicas start (a step in progress holds its target: no flapping on a slow start) and
  rises to three once they run (P may step back to 1 on its own signal);
- at the peak, the node of one D is removed (its raylet and every process on it killed)
  mid-stream: its streams resume on the other D, its worker's whole process group (vLLM's
  EngineCore included) is gone, and once a node with a D slot joins, Ray places a new D
  replica and the router routes to it (the D pool is back to 2);
- one stream left: D drains back to 1 replica under that stream (the replica leaves rotation,
  finishes its streams, then stops); no load: P drains back to 1;
- every request ends identically to transformers or with an explicit error: none lost, none
  wrong; no process group of a stopped or lost replica has a member left. The replica timeline
  and the request counts are written to the test logs as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.support.rayload import (
    Load,
    group_members,
    guard_groups,
    metric,
    model_id,
    processes,
    prompt_of,
)
from tests.support.workers import LOG_DIR, hf_greedy

SCALE_TOKENS = 24
PROMPT_LEN = 300
POOLS = ("prefill", "decode")
# the longest a replica start may take: two vLLM starts at once beside a running 1P1D took
# ~80 s on a quiet 2-core machine; this leaves room for a slower or busier CI machine
START_S = 300
# the longest the policies may take to decide a scale-up under the ramp's load
DECIDE_S = 180


class Timeline:
    """Routable replicas per pool (the directory's view) and Serve's replica states against the
    load, over time; also each registered worker's process group (to find leftovers at the
    end)."""

    def __init__(self, dep: Any, load: Load, marker: str) -> None:
        self.dep, self.load, self.t0 = dep, load, time.monotonic()
        self.marker = marker
        self.points: list[dict[str, Any]] = []
        self.peak: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self.most_starting = dict.fromkeys(POOLS, 0)
        self.port_groups: dict[str, int] = {}

    def serve_states(self) -> dict[str, dict[str, int]]:
        from ray import serve

        apps = serve.status().applications
        out = {}
        for kind in POOLS:
            app = apps.get(f"{self.dep.cfg.ray.name}-{kind}")
            states = app.deployments[kind].replica_states if app else {}
            out[kind] = {str(getattr(s, "value", s)): n for s, n in states.items()}
        return out

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(POOLS, 0)
        for w in self.dep.workers():
            if not w["draining"]:
                out[w["kind"]] += 1
        states = self.serve_states()
        for kind in POOLS:
            self.most_starting[kind] = max(self.most_starting[kind],
                                           states[kind].get("STARTING", 0))
        found = guard_groups(self.marker)
        for w in self.dep.workers():  # each registered worker's process group, by its port
            port = w["url"].rsplit(":", 1)[1]
            for g, cmds in found.items():
                if any(f"--port\0{port}\0" in c for c in cmds):
                    self.port_groups[port] = g
        self.points.append({"t": round(time.monotonic() - self.t0, 2),
                            "concurrency": self.load.concurrency, **out, "serve": states,
                            "guard_groups": len(found), "outcomes": dict(self.load.outcomes)})
        for kind, n in out.items():
            self.peak[kind] = max(self.peak.get(kind, 0), n)
        return out

    def mark(self, what: str) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 2), "event": what})

    def wait_starting(self, pools: tuple[str, ...], timeout_s: float) -> None:
        """Until Serve has started a replica of every pool named (a scale-up decided)."""
        self._until(lambda c: all(self.most_starting[k] or c[k] > 1 for k in pools),
                    f"scaling up {pools}", timeout_s)

    def wait_peak(self, want: dict[str, int], timeout_s: float) -> None:
        """Until every pool named has had that many routable replicas at some point (each pool
        follows its own signal: P may step back down while D still grows)."""
        self._until(lambda c: all(self.peak[k] >= n for k, n in want.items()),
                    f"peaked at {want}", timeout_s)

    def wait_started(self, kind: str, n: int, timeout_s: float) -> None:
        """Until Serve holds `n` replicas of `kind`, all running (none starting or stopping). A
        replica registers with the directory, and so is routable, seconds before Serve sees its
        constructor return."""
        self._until(lambda c: self.points[-1]["serve"][kind] == {"RUNNING": n},
                    f"{n} {kind} running in Serve", timeout_s)

    def wait(self, want: dict[str, int], timeout_s: float) -> None:
        """Until every pool named in `want` has that many routable replicas."""
        self._until(lambda c: all(c[k] == n for k, n in want.items()), f"reached {want}",
                    timeout_s)

    def _until(self, done: Callable[[dict[str, int]], bool], what: str, timeout_s: float
               ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(self.counts()):
                self.mark(what)
                return
            time.sleep(0.5)
        raise AssertionError(f"not {what} in {timeout_s} s: {self.points[-3:]}")


def wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return check()


def routed_roles(url: str) -> list[str]:
    return sorted(w["role"] for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"])


def group_of(port: str, marker: str) -> int:
    """The process group of the worker serving on `port`."""
    return next(g for g, cmds in guard_groups(marker).items()
                if any(f"--port\0{port}\0" in c for c in cmds))


def leftovers(gone: dict[str, int], marker: str) -> list[str]:
    """Processes left of stopped or lost workers (`gone`: port -> its guard's process group):
    any member of such a group, and any process of ours (its command line holds `marker`)
    still serving such a port."""
    out = []
    for pid, pgid, cmd in processes():
        port = cmd.split("--port\0", 1)[1].split("\0", 1)[0] if "--port\0" in cmd else None
        if pgid in gone.values() or (marker in cmd and port in gone):
            out.append(f"{pid} (group {pgid}): {cmd.replace(chr(0), ' ')[:160]}")
    return out


def retries(url: str, leg: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text,
                  "splitserve_router_retries_total", f'leg="{leg}"')


def test_pools_scale_apart_survive_a_node_loss_and_drain_back(
        ray_deployment: Any, ray_cluster: Any, llama_ckpt: Path) -> None:
    dep = ray_deployment
    prompts = [prompt_of(PROMPT_LEN, 10 + s) for s in range(4)]
    want = [hf_greedy(llama_ckpt, p, SCALE_TOKENS) for p in prompts]
    load = Load(dep.url, model_id(dep.url), prompts, want, SCALE_TOKENS)
    tl = Timeline(dep, load, str(llama_ckpt))
    before = {leg: retries(dep.url, leg) for leg in POOLS}
    at_loss: dict[str, int] = {}
    try:
        load.set(1)
        tl.mark("load 1")
        for _ in range(6):
            assert tl.counts() == {"prefill": 1, "decode": 1}  # one stream fits one of each
            time.sleep(0.5)
        load.set(4)
        tl.mark("load 4")
        # P's signal (prompt tokens queued, over a 2 s look-back) builds only when its short
        # prefills queue up: 44 s in one run here, more than 60 s in another
        tl.wait_starting(POOLS, DECIDE_S)
        # the steps are decided: one stream while the replicas start (each policy holds its
        # target while its step is in progress), three once they run (D's policy keeps 2)
        load.set(1)
        tl.mark("load 1")
        tl.wait({"decode": 2}, START_S)
        load.set(3)
        tl.mark("load 3")
        tl.wait_peak({"prefill": 2}, START_S)

        # the node of one D, removed mid-stream, once both Ds run in Serve's eyes: Serve
        # replaces a lost replica at once, beside one still starting, and the count of
        # replicas starting at once below is about the policies' steps
        tl.wait_started("decode", 2, START_S)
        time.sleep(2)  # streams on both D
        victim = next(w for w in dep.workers() if w["kind"] == "decode")
        node = next(n for n in ray_cluster.decode_nodes if n.node_id == victim["node_id"])
        lost_group = group_of(victim["url"].rsplit(":", 1)[1], tl.marker)
        at_loss = dict(load.outcomes)
        tl.mark(f"remove node of {victim['url']}")
        ray_cluster.cluster.remove_node(node, allow_graceful=False)
        ray_cluster.decode_nodes.remove(node)
        assert wait_for(lambda: not group_members({lost_group}), 30), group_members({lost_group})
        tl.mark("lost worker's process group gone")
        load.set(1)  # D's target holds at 2 (a step in progress) while Ray replaces it
        tl.mark("load 1")
        # the directory drops the lost D once Ray declares its node dead (seconds: the
        # cluster's health checks); until then it still counts it
        assert wait_for(lambda: victim["url"] not in {w["url"] for w in dep.workers()}, 60), \
            "the directory still lists the lost D"
        tl.mark("lost D left the directory")
        ray_cluster.add_decode_node()
        tl.mark("decode node added")
        tl.wait({"decode": 2}, START_S)
        assert wait_for(lambda: routed_roles(dep.url).count("decode") == 2, 30), \
            "the router does not route to the replacement D"
        tl.mark("router routes to the replacement D")

        tl.wait({"decode": 1}, 60)  # one stream fits one D: it drains one under that stream
        load.set(0)
        tl.mark("load 0")
        tl.wait({"prefill": 1, "decode": 1}, 60)
    finally:
        load.stop()
        summary = {"sent": sum(load.outcomes.values()), **dict(load.outcomes),
                   "after_node_loss": {k: n - at_loss.get(k, 0)
                                       for k, n in load.outcomes.items()},
                   "resumed_on_another_d": retries(dep.url, "decode") - before["decode"],
                   "prefill_retried": retries(dep.url, "prefill") - before["prefill"],
                   "most_starting_at_once": tl.most_starting, "details": load.details[:20],
                   "events": tl.events, "timeline": tl.points, "history": dep.history()}
        out = LOG_DIR / "ray-scale-timeline.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1))
        print("ray scale run: " + json.dumps({k: v for k, v in summary.items()
                                               if k not in ("timeline", "history")}))
    assert load.outcomes["wrong"] == 0 and load.outcomes["cut"] == 0, load.details
    assert load.outcomes["ok"] > 20
    assert tl.most_starting == {"prefill": 1, "decode": 1}  # one replica at a time
    assert wait_for(lambda: routed_roles(dep.url) == ["decode", "prefill"], 60), \
        "the router still holds a drained replica"
    # every stopped or lost replica's processes are gone (after its drain and vLLM's
    # shutdown): no member of its guard's group, no worker of ours still on its port
    assert wait_for(lambda: len(dep.workers()) == 2, 90), dep.workers()  # drained ones left
    live = {w["url"].rsplit(":", 1)[1] for w in dep.workers()}
    gone = {p: g for p, g in tl.port_groups.items() if p not in live}
    assert len(gone) >= 3  # the lost D, the drained D, and at least one P, were seen
    assert wait_for(lambda: leftovers(gone, tl.marker) == [], 60), leftovers(gone, tl.marker)
