"""A NIXL link in the profile: the probe (real nixl agents, loopback), and the simulator's pull
(the whole transfer after the prefill, D's replay of t1) against splitserve's layer-wise push."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from splitserve.bench.metrics import SLO
from splitserve.bench.workload import ArrivalSpec, LengthDist, WorkloadSpec
from splitserve.cli import main
from splitserve.sim.connectors import compare
from splitserve.sim.costmodel import TransferLink
from splitserve.sim.deployment import SimConfig
from splitserve.sim.links import nixl_link_from_side_by_side
from splitserve.sim.model import Profile, load_profile, save_profile
from splitserve.sim.planner import PlanRequest
from splitserve.sim.records import token_times
from splitserve.sim.results import itl_samples
from splitserve.sim.run import simulate
from splitserve.sim.workload import SimWorkload
from tests.sim.conftest import make_profile

# One request: 1,000 prompt tokens, 3 output tokens; the constructed profile's costs
L, OUT, HOP, PULL_REQ = 1000, 3, 0.01, 0.003
LINK = TransferLink(1e8, 0.002)
PREFILL_S = 0.02 + 0.001 * L + 1e-7 * L * L  # 1.12 s, one chunk


def decode_step(context: int) -> float:
    return 0.005 + 2e-6 * context + 1e-3  # batch 1


def one_request(connector: str
                ) -> tuple[float, float, float, float, np.ndarray, np.ndarray]:
    """(t1, t2, the KV's exposed tail, its transfer span, the client's token times, the
    pooled ITL samples) of a lone request over `connector`."""
    prof = replace(make_profile(), transfer={"tcp": LINK, "nixl": LINK})
    wl = SimWorkload(np.zeros(1), np.array([L]), np.array([OUT]))
    cfg = SimConfig("disagg", connector=connector,  # type: ignore[arg-type]
                    transport="nixl" if connector == "nixl" else "tcp", router_hop_s=HOP,
                    pull_request_s=PULL_REQ)
    o = simulate(prof, cfg, wl)
    values, weights = itl_samples(o)
    return (float(o.first_token[0]), float(o.second_token[0]), float(o.kv_tail_s[0]),
            float(o.kv_transfer_s[0]), token_times(o)[0], np.repeat(values, weights))


def test_nixl_pulls_after_the_prefill_and_replays_t1_while_splitserve_overlaps() -> None:
    send = L * 8192 / LINK.bandwidth_Bps  # 8 layers × 2 kv heads × 64 × 4 B × 2 per token
    t1, t2, kv, span, times, itl = one_request("splitserve")
    assert t1 == pytest.approx(PREFILL_S + HOP)
    # the push overlapped the prefill: only the last layer's share (+ latency) after it; the
    # transfer itself began once P's first layer was computed
    assert kv == pytest.approx(send / 8 + LINK.latency_s)
    assert span == pytest.approx(PREFILL_S * 7 / 8 + send / 8 + LINK.latency_s)
    assert t2 - t1 == pytest.approx(HOP + decode_step(L + 1))  # the leg, then D's one step
    n1, n2, nkv, nspan, ntimes, nitl = one_request("nixl")
    assert n1 == pytest.approx(t1)  # P's side is the same
    # the pull waits for D's leg (router hop + D's request round trip), then all of it crosses
    assert nkv == pytest.approx(HOP + HOP + PULL_REQ + send + LINK.latency_s)
    assert nspan == pytest.approx(send + LINK.latency_s)  # from the READ's post
    # D's first step replays t1 (context: the prompt), its second emits t2
    assert n2 - n1 == pytest.approx(HOP + PULL_REQ + send + LINK.latency_s
                                    + decode_step(L) + decode_step(L + 1))
    assert (n2 - n1) - (t2 - t1) == pytest.approx(PULL_REQ + send + LINK.latency_s
                                                  + decode_step(L))
    # the client sees t1 and t2..tN, never the replay; ITL: the handover and D's decode gap
    assert len(ntimes) == OUT and ntimes[1] == pytest.approx(n2)
    assert ntimes[2] - ntimes[1] == pytest.approx(decode_step(L + 2))
    assert sorted(nitl) == pytest.approx(sorted([n2 - n1, decode_step(L + 2)]))
    assert sorted(itl) == pytest.approx(sorted([t2 - t1, decode_step(L + 2)]))


def test_profile_adds_a_nixl_link_measured_by_real_agents(tmp_path: Path) -> None:
    """`splitserve profile --add-links --nixl-probe`: NIXL READs between two local agents (every
    READ's bytes checked against P's pattern; a wrong byte raises), fitted into a `nixl` link
    beside the profile's others."""
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    out = tmp_path / "p-nixl.json"
    assert main(["profile", "--add-links", str(prof), "--nixl-probe", "--no-tcp-probe",
                 "--out", str(out)]) == 0
    got = load_profile(out)
    assert set(got.transfer) == {"tcp", "nixl"} and got.transfer["tcp"] == LINK
    link = got.transfer["nixl"]
    assert link.bandwidth_Bps > 0 and link.latency_s >= 0
    # one descriptor per KV block and layer: 128 tokens × 2 kv heads × 64 × 4 B
    assert "nixl probe" in link.source and "DRAM->DRAM" in link.source
    assert "65536 B descriptors" in link.source
    # a 1 MiB READ takes what the link says, within the noise of a shared machine
    assert 0 < link.time(1 << 20) < 1.0


def test_the_probes_caller_exits_cleanly() -> None:
    """The agents live in child processes: the caller, which only reads their result, exits 0
    (a process that built a NIXL agent crashed at its exit here)."""
    script = ("from splitserve.sim.nixl_probe import measure_reads; "
              "print(sorted(measure_reads(sizes=(1 << 16, 1 << 18), repeats=1)))")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=180, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip().splitlines()[-1] == "[65536, 262144]"  # NIXL logs above it


def _two_link_profile(tcp: TransferLink, nixl: TransferLink) -> Profile:
    return replace(make_profile(), transfer={"tcp": tcp, "nixl": nixl})


SPEC = WorkloadSpec(num_requests=300, input=LengthDist("fixed", 1000),
                    output=LengthDist("fixed", 4), arrival=ArrivalSpec("poisson", 1.0), seed=2)


def test_plan_compares_the_connectors_each_way_by_their_links() -> None:
    """Short outputs and a tight TPOT: the handover decides. With equal links splitserve's
    push (hidden behind the prefill) beats NIXL's pull (exposed, plus the replay step); with a
    slow tcp link that no overlap can hide (0.8 s of transfer) and a fast nixl one, NIXL wins."""
    req = PlanRequest(rate=1.0, slo=SLO(3000, 60), workers=3, pull_request_s=PULL_REQ)
    links = {"splitserve": "tcp", "nixl": "nixl"}
    even = compare(_two_link_profile(LINK, LINK), SPEC, req, links)
    assert [cp.connector for cp in even.ranked] == ["splitserve", "nixl"]
    ss, nx = (cp.plan for cp in even.plans)
    by_ss = {c.label: c for c in ss.candidates}
    by_nx = {c.label: c for c in nx.candidates}
    # at the same P:D, NIXL's handover is longer by D's request round trip, the part of the
    # transfer the push hid behind the prefill (all but the last of 8 layers), and the replay
    send = L * 8192 / LINK.bandwidth_Bps
    for label in ("1P:2D", "2P:1D"):
        extra = by_nx[label].metrics["median_handover_ms"] - by_ss[label].metrics[
            "median_handover_ms"]
        assert extra == pytest.approx(1000 * (PULL_REQ + send * 7 / 8 + decode_step(L)),
                                      rel=0.05)
    assert by_ss["colocated"].goodput == by_nx["colocated"].goodput  # no connector there
    assert even.verdict.startswith("splitserve (tcp) wins")
    flip = compare(_two_link_profile(TransferLink(1e7, 0.002), TransferLink(1e10, 0.0)),
                   SPEC, req, links)
    assert [cp.connector for cp in flip.ranked] == ["nixl", "splitserve"]
    assert flip.verdict.startswith("nixl (nixl) wins")
    assert (flip.plans[1].best_split.goodput or 0.0) > (flip.plans[0].best_split.goodput or 0.0)
    # a TPOT SLO no handover can miss: the connectors are level, and say so
    fast = TransferLink(1e12, 0.0)
    level = compare(_two_link_profile(fast, fast), SPEC, replace(req, slo=SLO(3000, 1000)),
                    links)
    assert level.level and "are level on this workload" in level.verdict
    assert level.to_dict()["winner"] is None and not even.level


def test_plan_command_compares_connectors(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    prof = tmp_path / "p.json"
    save_profile(_two_link_profile(LINK, LINK), prof)
    out = tmp_path / "plan"
    assert main(["plan", "--profile", str(prof), "--workers", "3", "--connector", "compare",
                 "--num-prompts", "300", "--input-len", "1000", "--output-len", "4",
                 "--request-rate", "1", "--seed", "2", "--slo-ttft-ms", "3000",
                 "--slo-tpot-ms", "60", "--pull-request-ms", "3", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "connectors: splitserve (tcp) wins" in text
    got = json.loads((out / "compare.json").read_text())
    assert got["winner"] == "splitserve"
    assert [c["connector"] for c in got["connectors"]] == ["splitserve", "nixl"]
    assert [c["plan"]["transport"] for c in got["connectors"]] == ["tcp", "nixl"]
    assert (out / "plan-nixl.png").stat().st_size > 0
    # without a nixl link there is nothing to compare against
    save_profile(make_profile(), prof)
    assert main(["plan", "--profile", str(prof), "--workers", "3", "--connector", "compare",
                 "--slo-ttft-ms", "3000", "--slo-tpot-ms", "60", "--out-dir", str(out)]) == 2
    assert capsys.readouterr().err.startswith("splitserve plan: the profile has no ['nixl'] link")


def test_the_nixl_link_from_vllms_own_pulls(tmp_path: Path) -> None:
    """benchmarks/nixl_side_by_side.py's probes: the median pull per prompt length, fitted over
    the KV bytes, and D's leg beyond its pull."""
    def run(pull: float, d_queue: float) -> dict[str, float | None]:
        return {"nixl_xfer_s": pull, "d_queue_s": d_queue, "kv_tail_s": None}

    side = {"nixl": {"probes": {
        "256": [run(0.004, 0.07), run(0.005, 0.08), run(0.009, 0.2)],
        "2048": [run(0.030, 0.10), run(0.031, 0.11), run(0.050, 0.3)]}},
        "tcp": {"probes": {"256": [{"nixl_xfer_s": None, "d_queue_s": 0.1}]}}}
    path = tmp_path / "nixl_side_by_side.json"
    path.write_text(json.dumps(side))
    link, beyond = nixl_link_from_side_by_side(path, 8192)
    # medians 5 ms at 2 MiB and 31 ms at 16 MiB: 26 ms per 14 MiB, and the rest is latency
    assert link.bandwidth_Bps == pytest.approx(1792 * 8192 / 0.026)
    assert link.latency_s == pytest.approx(0.005 - 256 * 8192 * 0.026 / (1792 * 8192))
    assert "nixl_xfer_time_seconds" in link.source
    assert beyond == pytest.approx(0.077)  # median of d_queue − pull over both lengths
    path.write_text(json.dumps({"tcp": side["tcp"]}))
    with pytest.raises(ValueError, match="no nixl probes"):
        nixl_link_from_side_by_side(path, 8192)


def test_sim_command_runs_either_connector(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    save_profile(_two_link_profile(LINK, LINK), prof)
    got = {}
    for connector in ("splitserve", "nixl"):
        out = tmp_path / f"{connector}.json"
        assert main(["sim", "--profile", str(prof), "--prefill", "1", "--decode", "1",
                     "--connector", connector, "--pull-request-ms", "3", "--num-prompts", "20",
                     "--input-len", "1000", "--output-len", "4", "--request-rate", "0.5",
                     "--seed", "2", "--out", str(out)]) == 0
        got[connector] = json.loads(out.read_text())
    assert got["nixl"]["sim"]["config"]["connector"] == "nixl"
    assert got["nixl"]["sim"]["config"]["transport"] == "nixl"  # the connector's own link
    assert got["splitserve"]["sim"]["config"]["transport"] == "tcp"
    # lone requests (0.5 req/s against a 1.12 s prefill): P's side is the same; NIXL's
    # handover is the pull's exposed part, D's round trip and the replay step longer
    assert got["nixl"]["median_ttft_ms"] == pytest.approx(got["splitserve"]["median_ttft_ms"])
    send = L * 8192 / LINK.bandwidth_Bps
    assert got["nixl"]["median_handover_ms"] - got["splitserve"]["median_handover_ms"] == (
        pytest.approx(1000 * (PULL_REQ + send * 7 / 8 + decode_step(L)), rel=0.05))


def test_a_busy_d_posts_the_read_at_its_next_step() -> None:
    """D decodes a long stream when the second request's leg reaches it: vLLM's scheduler
    posts the READ in D's next step, so the pull starts at the end of D's step in progress."""
    prof = replace(make_profile(), transfer={"nixl": LINK})
    wl = SimWorkload(np.array([0.0, 0.5]), np.array([100, L]), np.array([400, 3]))
    cfg = SimConfig("disagg", connector="nixl", transport="nixl", pull_request_s=PULL_REQ)
    o = simulate(prof, cfg, wl)
    p_end = 0.5 + PREFILL_S  # P was idle when the second prompt came
    leg_in = p_end + PULL_REQ
    d_steps = token_times(o)[0][1:]  # the first stream's tokens: D's step ends
    assert d_steps[0] < leg_in < d_steps[-1]  # D is decoding then
    post = float(d_steps[d_steps >= leg_in][0])
    assert post > leg_in
    send = L * 8192 / LINK.bandwidth_Bps
    assert float(o.kv_tail_s[1]) == pytest.approx(post + send + LINK.latency_s - p_end)
    assert float(o.kv_transfer_s[1]) == pytest.approx(send + LINK.latency_s)
    # the leg joins D at the step boundary after the KV is in; the step after it replays t1,
    # the one after that emits t2
    joined = float(d_steps[d_steps >= post + send + LINK.latency_s][0])
    assert float(o.second_token[1]) == pytest.approx(float(d_steps[d_steps > joined][1]))


def test_p_waits_for_the_pull_to_free_its_kv() -> None:
    """P's KV holds one prompt: the second waits until D's pull of the first has ended (the
    pull is posted after P went idle, and its end wakes P)."""
    prof = replace(make_profile(capacity=1500), transfer={"nixl": LINK})
    wl = SimWorkload(np.zeros(2), np.array([L, L]), np.array([OUT, OUT]))
    cfg = SimConfig("disagg", connector="nixl", transport="nixl", pull_request_s=PULL_REQ)
    o = simulate(prof, cfg, wl)
    freed = PREFILL_S + PULL_REQ + L * 8192 / LINK.bandwidth_Bps  # D idle: READ posted at once
    assert o.first_token[0] == pytest.approx(PREFILL_S)
    assert o.first_token[1] == pytest.approx(freed + PREFILL_S)
    assert not o.failed.any() and np.isfinite(o.finish).all()


def test_mooncake_sends_the_whole_blocks_when_ps_prefill_ends() -> None:
    """Mooncake's D leg goes out with P's: P sends its whole blocks the moment its prefill
    ends (no router hop, no D step to post a READ), and D's first step after they are in
    replays t1. A lone request's handover is NIXL's less D's round trip; splitserve's
    layer-wise push exposes only its last layer."""
    prof = replace(make_profile(), transfer={"nixl": LINK, "tcp": LINK})
    wl = SimWorkload(np.array([0.0]), np.array([L]), np.array([OUT]))
    got = {c: simulate(prof, SimConfig("disagg", connector=c, transport="nixl" if c == "nixl"
                                       else "tcp", pull_request_s=PULL_REQ), wl)
           for c in ("splitserve", "nixl", "mooncake")}
    send = L * 8192 / LINK.bandwidth_Bps
    moon = got["mooncake"]
    assert float(moon.first_token[0]) == pytest.approx(PREFILL_S)
    assert float(moon.kv_transfer_s[0]) == pytest.approx(send + LINK.latency_s)
    assert float(moon.kv_tail_s[0]) == pytest.approx(send + LINK.latency_s)
    handover = {c: float(o.second_token[0] - o.first_token[0]) for c, o in got.items()}
    assert handover["nixl"] - handover["mooncake"] == pytest.approx(PULL_REQ)
    assert handover["splitserve"] < handover["mooncake"]
    assert not moon.failed.any() and np.isfinite(moon.finish).all()


def test_a_mooncake_leg_joins_d_no_earlier_than_t1() -> None:
    """A router hop longer than the transfer: the blocks are at D before the client has t1,
    but D's tokens follow t1 through the router, so its replay step starts at t1."""
    hop = 0.2
    prof = replace(make_profile(), transfer={"tcp": LINK})
    wl = SimWorkload(np.array([0.0]), np.array([L]), np.array([OUT]))
    o = simulate(prof, SimConfig("disagg", connector="mooncake", router_hop_s=hop), wl)
    assert L * 8192 / LINK.bandwidth_Bps + LINK.latency_s < hop
    t1, t2 = float(o.first_token[0]), float(o.second_token[0])
    assert t1 == pytest.approx(PREFILL_S + hop)
    assert t2 - t1 == pytest.approx(decode_step(L) + decode_step(L + 1))
