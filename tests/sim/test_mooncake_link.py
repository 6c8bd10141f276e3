"""A Mooncake link in the profile: the probe (two real transfer engines over tcp, loopback, in
child processes) through `splitserve profile --add-links --mooncake-probe`, and the link the
simulator picks for each connector."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.sim.cli_args import transport_for
from splitserve.sim.costmodel import TransferLink
from splitserve.sim.model import load_profile, save_profile
from splitserve.sim.mooncake_probe import measure_writes
from tests.sim.conftest import make_profile

LINK = TransferLink(1e8, 0.002)
CLI = "import sys; from splitserve.cli import main; sys.exit(main(sys.argv[1:]))"


def test_profile_adds_a_mooncake_link_measured_by_real_engines(tmp_path: Path) -> None:
    """Run as a user runs it, in its own process: the engines live in child processes, so the
    caller writes the profile and exits 0; D checked every write's bytes."""
    prof = tmp_path / "p.json"
    save_profile(replace(make_profile(), transfer={"tcp": LINK}), prof)
    out = tmp_path / "p-mooncake.json"
    child = subprocess.run(
        [sys.executable, "-c", CLI, "profile", "--add-links", str(prof), "--mooncake-probe",
         "--no-tcp-probe", "--out", str(out)], capture_output=True, text=True, timeout=180,
        check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    got = load_profile(out)
    assert set(got.transfer) == {"tcp", "mooncake"} and got.transfer["tcp"] == LINK
    link = got.transfer["mooncake"]
    assert "mooncake probe" in link.source and "over tcp" in link.source
    # one entry per KV block and layer: 128 tokens × 2 kv heads × 64 × 4 B
    assert "65536 B entries" in link.source
    assert link.bandwidth_Bps > 0 and link.latency_s >= 0
    assert 0 < link.time(1 << 20) < 1.0  # a 1 MiB write, within a shared machine's noise

    def pick(connector: str) -> str:
        args = argparse.Namespace(transport=None, connector=connector)
        return transport_for(args, got, connector)

    assert (pick("mooncake"), pick("splitserve")) == ("mooncake", "tcp")
    assert transport_for(argparse.Namespace(transport=None, connector="mooncake"),
                         replace(got, transfer={"tcp": LINK}), "mooncake") == "tcp"


def test_the_probe_refuses_sizes_below_one_entry() -> None:
    with pytest.raises(ValueError, match="sizes >= desc_bytes"):
        measure_writes(sizes=(1 << 10,), desc_bytes=1 << 16)
