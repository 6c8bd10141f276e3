"""TTFT and handover at no load: 1P1D through splitserve's router vs. a colocated worker reached
directly and pinned to the same cores as the P-worker, for prompts of 256-4,096 tokens.

Target: disaggregated TTFT <= colocated TTFT x 1.05 + 2 ms. Handover = t1 at the client -> t2
at the client. Timings are printed and written to JSON, never asserted.

Four systems are up for the whole run and their requests alternate, each with a fresh prompt,
so drift of this shared machine hits all alike; per-pair differences are reported next to the
medians:
- `1p1d`: the deployment, through the router;
- `colocated`: a separate plain vLLM worker on the P-worker's cores (the baseline as specified);
- `colocated-all`: a plain vLLM worker on all of the deployment's cores (P's and D's: the demo's
  colocated arm at no load). Against `colocated` it is what the second core buys a prefill:
  the part of 1P1D's TTFT price on the demo that no handover or router change can remove;
- `p-direct`: the P-worker itself, sent a plain request (no KV push: it serves it colocated).
  Two vLLM processes on the same core can differ in speed by 10-15 % for as long as they live;
  this baseline is the same process as P, so `1p1d` against it is the cost of disaggregation
  alone (router hop + KV push), free of that instance-to-instance spread;
- `p-push`: the P-worker sent the router's prefill leg by hand (`kv_transfer_params` naming
  D's KV endpoint; the staged KV is discarded on D once complete). Against `p-direct` it is
  the push's cost to P's TTFT; `1p1d` against it is the router's.
A quiet gap follows every request: a worker's step queues busy-poll after its last step (for
100 ms in splitserve's workers, 1 s as vLLM ships them), and the baselines share the P-worker's
core, so back-to-back requests would charge one system's idle spin to the next.

    python benchmarks/handover.py [--model DIR] [--lengths 256,1024,4096] [--reps 7] [--gap-s 1.2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import StreamTiming, summary, timed_stream, write_json  # noqa: E402
from _common import random_prompt as prompt  # noqa: E402

from splitserve.common.cpus import parse_cpus  # noqa: E402
from splitserve.common.wire import WorkerInfo  # noqa: E402
from splitserve.config import WorkerConfig, bearer_headers  # noqa: E402
from splitserve.launch.config import DeploymentConfig  # noqa: E402
from splitserve.launch.local import LocalDeployment  # noqa: E402
from splitserve.router.legs import push_target  # noqa: E402
from splitserve.worker.launch import free_port, start_worker, wait_healthy  # noqa: E402

Runs = dict[int, list[StreamTiming]]


@dataclass(frozen=True)
class PushLeg:
    """What turns a request to the P-worker into the router's prefill leg: a push to D."""

    p: httpx.Client  # P's and D's HTTP APIs, with the deployment token
    d: httpx.Client
    endpoint: dict[str, Any]  # D's KV endpoint, as the router sends it

    def params(self) -> tuple[str, dict[str, Any]]:
        tid = f"handover-{uuid.uuid4().hex[:12]}"
        return tid, {"do_remote_decode": True, "transfer_id": tid, **self.endpoint}

    def copy_forward_s(self, tid: str) -> float | None:
        """P's record: seconds its forward thread spent copying the transfer's KV."""
        r = self.p.get(f"/splitserve/transfers/{tid}")
        return r.json().get("send", {}).get("copy_forward_s") if r.status_code == 200 else None

    def discard(self, tid: str, timeout_s: float = 10.0) -> str:
        """Wait until D's record of the transfer is final, free it there; its status."""
        deadline, status = time.monotonic() + timeout_s, "missing"
        while time.monotonic() < deadline:
            r = self.d.get(f"/splitserve/transfers/{tid}")
            if r.status_code == 200:
                rec = r.json()
                status = str(rec.get("recv", rec).get("status"))
                if status != "open":
                    break
            time.sleep(0.02)
        self.d.delete(f"/splitserve/transfers/{tid}")
        return status


def run(systems: dict[str, httpx.Client], model: str, lengths: list[int], reps: int,
        vocab: int, max_tokens: int, gap_s: float, push: PushLeg) -> dict[str, Runs]:
    """Every (length, rep) sends one request to each system in turn, quiet gap after each.
    Each client carries its system's base URL and credentials; `p-push` requests carry `push`'s
    transfer parameters."""
    out: dict[str, Runs] = {name: {} for name in systems}

    def send(name: str, length: int, seed: int, tokens: int) -> StreamTiming:
        body = {"model": model, "prompt": prompt(length, seed, vocab), "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}
        tid = None
        if name == "p-push":
            tid, body["kv_transfer_params"] = push.params()
        timing = timed_stream(systems[name], "", body)
        if tid is not None:
            timing.server["kv_status"] = push.discard(tid)
            timing.server["copy_forward_s"] = push.copy_forward_s(tid)
        time.sleep(gap_s)
        return timing

    for i, name in enumerate(systems):
        for w in range(2):  # warm-up (and the push channel connected)
            send(name, 64, 10 * i + w, 2)
    for length in lengths:
        for rep in range(reps):
            for i, name in enumerate(systems):
                # a fresh prompt every time: no prefix-cache hit anywhere
                seed = 1000 * length + len(systems) * rep + i + 100
                out[name].setdefault(length, []).append(send(name, length, seed, max_tokens))
    return out


def ms(ts: list[StreamTiming]) -> float:
    return statistics.median(t.ttft for t in ts) * 1e3


def paired_ms(a: list[StreamTiming], b: list[StreamTiming]) -> float:
    return statistics.median(x.ttft - y.ttft for x, y in zip(a, b, strict=True)) * 1e3


def row_for(length: int, d: list[StreamTiming], c: list[StreamTiming], p: list[StreamTiming],
            pp: list[StreamTiming], call: list[StreamTiming]) -> dict[str, Any]:
    kv_ms = [t.server["kv_transfer_s"] * 1e3 for t in d
             if isinstance(t.server.get("kv_transfer_s"), int | float)]
    kv_mb = [t.server["kv_bytes"] / 1e6 for t in d
             if isinstance(t.server.get("kv_bytes"), int | float)]
    target, target_p = ms(c) * 1.05 + 2.0, ms(p) * 1.05 + 2.0
    return {
        "prompt_tokens": length,
        "ttft_1p1d_ms": summary([t.ttft for t in d]),
        "ttft_colocated_ms": summary([t.ttft for t in c]),
        "ttft_p_direct_ms": summary([t.ttft for t in p]),
        "ttft_colocated_all_ms": summary([t.ttft for t in call]),
        # 1P1D's TTFT over a plain worker's on all the cores, and the P-worker's cores' over
        # all the cores' (no load: compute alone)
        "ratio_1p1d_vs_all": ms(d) / ms(call), "ratio_p_cores_vs_all": ms(c) / ms(call),
        "target_ms": target, "target_met": ms(d) <= target,
        "target_vs_p_direct_ms": target_p, "target_vs_p_direct_met": ms(d) <= target_p,
        "paired_diff_vs_colocated_ms": paired_ms(d, c),
        "paired_diff_vs_p_direct_ms": paired_ms(d, p),
        "ttft_p_push_ms": summary([t.ttft for t in pp]),
        # the two parts of that difference, each paired within one run
        "push_cost_ms": paired_ms(pp, p),  # P's TTFT with a push to D, less without
        "router_cost_ms": paired_ms(d, pp),  # through the router, less P's leg sent by hand
        "p_push_kv_status": sorted({str(t.server.get("kv_status")) for t in pp}),
        # P's own record of each push: its forward thread's seconds copying the KV out
        "p_copy_forward_ms": summary([t.server["copy_forward_s"] for t in pp
                                      if isinstance(t.server.get("copy_forward_s"), float)]),
        "handover_1p1d_ms": summary([t.gaps[0] for t in d if t.gaps]),
        "first_itl_colocated_ms": summary([t.gaps[0] for t in c if t.gaps]),
        "p_leg_ms": summary([t.server["p_leg_s"] for t in d if t.server.get("p_leg_s")]),
        # the router's share: the client's TTFT minus P's leg as the router timed it; of it,
        # the router's own work (its clock: request parsed -> first chunk written, less P's
        # leg) and the rest (the client's HTTP hop to the router and back)
        "router_ms": summary([t.ttft - t.server["p_leg_s"] for t in d
                              if t.server.get("p_leg_s")]),
        "router_inside_ms": summary([t.server["ttft_s"] - t.server["p_leg_s"] for t in d
                                     if t.server.get("p_leg_s") and t.server.get("ttft_s")]),
        "router_hop_ms": summary([t.ttft - t.server["ttft_s"] for t in d
                                  if t.server.get("ttft_s")]),
        "kv_transfer_ms_median": statistics.median(kv_ms) if kv_ms else None,
        "kv_mb_median": statistics.median(kv_mb) if kv_mb else None,
        "kv_status": sorted({str(t.server.get("kv_status")) for t in d}),
        "raw_ttft_ms": {name: [round(t.ttft * 1e3, 2) for t in ts]
                        for name, ts in (("1p1d", d), ("colocated", c), ("p-direct", p),
                                         ("p-push", pp), ("colocated-all", call))},
    }


def print_row(r: dict[str, Any]) -> None:
    def med(key: str) -> float:
        return float(r[key].get("median_ms", float("nan")))

    print(f"{r['prompt_tokens']:>7} {med('ttft_1p1d_ms'):>9.1f} {med('ttft_colocated_ms'):>9.1f} "
          f"{r['target_ms']:>8.1f} {'yes' if r['target_met'] else 'NO':>4} "
          f"{r['paired_diff_vs_colocated_ms']:>+7.1f} {med('ttft_p_direct_ms'):>9.1f} "
          f"{'yes' if r['target_vs_p_direct_met'] else 'NO':>4} "
          f"{r['paired_diff_vs_p_direct_ms']:>+7.1f} {r['push_cost_ms']:>+6.1f} "
          f"{r['router_cost_ms']:>+7.1f} {med('handover_1p1d_ms'):>9.1f} "
          f"{med('first_itl_colocated_ms'):>6.1f} "
          f"{r['kv_transfer_ms_median'] or float('nan'):>7.1f} "
          f"{r['kv_mb_median'] or float('nan'):>6.2f} {med('ttft_colocated_all_ms'):>8.1f} "
          f"{r['ratio_1p1d_vs_all']:>6.2f} {r['ratio_p_cores_vs_all']:>6.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=1.2,
                    help="quiet time after every request (workers busy-poll 0.1-1 s after a step)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--transport", choices=("tcp", "shm"), default="tcp")
    ap.add_argument("--router-cpus", type=parse_cpus, default=None,
                    help="the router's cores, e.g. 1 (default: the launcher's plan)")
    ap.add_argument("--client-cpus", type=parse_cpus, default=None,
                    help="this client's cores, e.g. 1")
    ap.add_argument("--out", default="benchmarks/results/handover.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    dep = LocalDeployment(DeploymentConfig(prefill=1, decode=1, model=args.model,
                                           transport=args.transport, port=free_port(),
                                           router_cpus=args.router_cpus,
                                           log_dir=f"/tmp/splitserve-handover-{time.time():.0f}"))
    dep.start()  # its core plan reads this process's affinity: pin the client only after it
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    colocated = colocated_all = None
    try:
        model = httpx.get(f"{dep.url}/v1/models").json()["data"][0]["id"]
        vocab = int(json.loads((Path(dep.model_dir) / "config.json").read_text())["vocab_size"])
        p_cfg = dep.workers[0]
        ccfg = WorkerConfig(model=dep.model_dir, port=free_port(), cpus=p_cfg.cpus,
                            dtype=p_cfg.dtype, max_model_len=p_cfg.max_model_len,
                            served_model_name=p_cfg.served_model_name)
        colocated = start_worker(ccfg, None, str(dep.log_dir / "colocated.log"))
        wait_healthy(ccfg.url, colocated)
        all_cores = tuple(sorted({c for w in dep.workers for c in (w.cpus or ())}))
        acfg = replace(ccfg, port=free_port(), cpus=all_cores or None)
        colocated_all = start_worker(acfg, None, str(dep.log_dir / "colocated-all.log"))
        wait_healthy(acfg.url, colocated_all)
        systems = {
            "1p1d": httpx.Client(base_url=dep.url, timeout=300),
            "colocated": httpx.Client(base_url=ccfg.url, timeout=300),
            "p-direct": httpx.Client(base_url=p_cfg.url, timeout=300,
                                     headers=bearer_headers(dep.token)),
            "p-push": httpx.Client(base_url=p_cfg.url, timeout=300,
                                   headers=bearer_headers(dep.token)),
            "colocated-all": httpx.Client(base_url=acfg.url, timeout=300),
        }
        d_client = httpx.Client(base_url=dep.workers[1].url, timeout=30,
                                headers=bearer_headers(dep.token))
        info = WorkerInfo.from_json(d_client.get("/splitserve/info").json())
        endpoint = push_target(info, args.transport)
        if endpoint is None:
            raise SystemExit("the D-worker advertises no KV endpoint")
        push = PushLeg(systems["p-push"], d_client, endpoint)
        res = run(systems, model, lengths, args.reps, vocab, args.max_tokens, args.gap_s, push)
    finally:
        for proc in (colocated, colocated_all):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
        dep.stop()

    print(f"{'':>7} {'--- TTFT ms ---':^28} {'':>4} {'paired':>7} {'P-direct':>9} {'met':>4} "
          f"{'paired':>7} {'of which':^14}")
    print(f"{'prompt':>7} {'1P1D':>9} {'coloc':>9} {'target':>8} {'met':>4} {'vs col':>7} "
          f"{'TTFT':>9} {'':>4} {'vs P':>7} {'push':>6} {'router':>7} {'handover':>9} "
          f"{'ITL1c':>6} {'KV ms':>7} {'KV MB':>6} {'all-core':>8} {'1P1D/':>6} {'cores/':>6}")
    rows = []
    for length in lengths:
        rows.append(row_for(length, res["1p1d"][length], res["colocated"][length],
                            res["p-direct"][length], res["p-push"][length],
                            res["colocated-all"][length]))
        print_row(rows[-1])
    write_json(Path(args.out), {
        "benchmark": "handover", "model": args.model, "transport": args.transport,
        "reps": args.reps, "max_tokens": args.max_tokens, "gap_s": args.gap_s,
        "core_plan": dep.core_note, "client_cpus": list(args.client_cpus or ()),
        "order": "interleaved per rep: " + ", ".join(systems),
        "prefill_cpus": list(p_cfg.cpus or ()), "rows": rows,
        "target": "disaggregated TTFT <= colocated TTFT x 1.05 + 2 ms (medians)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
