"""A profile's measured KV transfer links (`costmodel.TransferLink`: bytes / bw + latency).

- `links_from_benchmark`: per transport, from a KV-transfer benchmark JSON
  (`benchmarks/kv_transfer.py` writes one): the connector's own transfers;
- `probe_loopback_tcp`: this host's loopback socket copy cost (not the connector's protocol);
- `sim.nixl_probe.probe_nixl`: NIXL READs DRAM to DRAM between two local agents (the transport,
  not the NixlConnector's whole pull);
- `sim.mooncake_probe.probe_mooncake`: Mooncake transfer-engine WRITEs DRAM to DRAM between two
  local engines (the engine, not the MooncakeConnector's whole handover);
- `measured_links`: what `splitserve profile` puts in a measured profile.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from splitserve.sim.costmodel import TransferLink, fit_link, fit_link_or_span
from splitserve.sim.mooncake_probe import probe_mooncake
from splitserve.sim.nixl_probe import probe_nixl

_DURATION_KEYS = ("duration_s", "median_s", "seconds", "time_s")


def links_from_benchmark(path: str | Path) -> dict[str, TransferLink]:
    """Per-transport links from a KV-transfer benchmark JSON (benchmarks/kv_transfer.py writes
    one): every object carrying `bytes` and a duration (`duration_s`, `median_s`, `seconds` or
    `time_s`) is a sample of the transport named by its own
    `transport` key or by the nearest enclosing object's (e.g. the connector's per-transfer
    records inside a `{"transport": "shm", "transfers": [...]}` block)."""
    samples: dict[str, list[tuple[float, float]]] = {}

    def walk(node: Any, transport: str | None) -> None:
        if isinstance(node, dict):
            transport = str(node.get("transport", transport)) if (
                node.get("transport", transport) is not None) else None
            dur = next((node[k] for k in _DURATION_KEYS if k in node), None)
            if transport and isinstance(node.get("bytes"), int | float) and isinstance(
                    dur, int | float) and dur > 0:
                samples.setdefault(transport, []).append((float(node["bytes"]), float(dur)))
            for v in node.values():
                walk(v, transport)
        elif isinstance(node, list):
            for v in node:
                walk(v, transport)

    walk(json.loads(Path(path).read_text()), None)
    if not samples:
        raise ValueError(f"{path}: no transfer records with a transport, bytes and a duration")
    return {t: fit_link(s, f"benchmark {Path(path).name}") for t, s in samples.items()}


def probe_loopback_tcp(sizes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 23, 1 << 25),
                       repeats: int = 5) -> TransferLink:
    """Time sending buffers over a loopback TCP socket (this host's socket copy cost, not the
    connector's own protocol): the fastest of `repeats` tries per size (a busy machine only ever
    adds time), then bandwidth and latency fitted; if the fit degenerates, bandwidth from the
    largest size and latency from the smallest."""
    best: dict[int, float] = {}
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def sink() -> None:
            conn, _ = srv.accept()
            with conn:
                for n in [n for n in sizes for _ in range(repeats)]:
                    got = 0
                    while got < n:
                        got += len(conn.recv(1 << 20))
                    conn.sendall(b"k")

        th = threading.Thread(target=sink, daemon=True)
        th.start()
        with socket.create_connection(("127.0.0.1", port)) as cli:
            for n in [n for n in sizes for _ in range(repeats)]:
                buf = bytes(n)
                t0 = time.perf_counter()
                cli.sendall(buf)
                cli.recv(1)
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
        th.join(timeout=10)
    return fit_link_or_span(best, "loopback TCP probe of this host (not the connector)")


def measured_links(transfer_json: str | None = None, probe_tcp: bool = True,
                   nixl_desc_bytes: int | None = None, mooncake_desc_bytes: int | None = None
                   ) -> dict[str, TransferLink]:
    """A measured profile's KV links by transport: with `probe_tcp`, `tcp` from a loopback
    TCP probe of this host (`probe_loopback_tcp`: the CPU default when nothing better is
    measured, labelled as such); with `nixl_desc_bytes` (a KV block's bytes per layer), `nixl`
    from NIXL READs of such descriptors between two local agents (`sim.nixl_probe`); with
    `mooncake_desc_bytes`, `mooncake` from transfer-engine WRITEs of such entries between two
    local engines over tcp (`sim.mooncake_probe`); then every transport a KV-transfer
    benchmark JSON measured (`links_from_benchmark`), which replaces the probes' links of the
    same name."""
    links: dict[str, TransferLink] = {}
    if probe_tcp:
        links["tcp"] = probe_loopback_tcp()
    if nixl_desc_bytes is not None:
        links["nixl"] = probe_nixl(desc_bytes=nixl_desc_bytes)
    if mooncake_desc_bytes is not None:
        links["mooncake"] = probe_mooncake(desc_bytes=mooncake_desc_bytes)
    if transfer_json:
        links |= links_from_benchmark(transfer_json)
    return links


def nixl_link_from_side_by_side(path: str | Path, kv_bytes_per_token: int
                                ) -> tuple[TransferLink, float | None]:
    """The `nixl` link from vLLM's own pulls, as `benchmarks/nixl_side_by_side.py` measures
    them: its `nixl` arm's TTFT probes (prompt length → runs, each one pull whose
    `nixl_xfer_s` is the delta of D's `vllm:nixl_xfer_time_seconds`), the median per length
    fitted over length × `kv_bytes_per_token` bytes. Also the median of D's leg beyond its
    pull (`d_queue_s − nixl_xfer_s`: D's leg sent → D's first token, less the pull; it holds
    D's request round trip and its replay step), in seconds, or None if not recorded."""
    import statistics

    data = json.loads(Path(path).read_text())
    probes = (data.get("nixl") or {}).get("probes") or {}
    samples, beyond = [], []
    for length, runs in probes.items():
        pulls = [r["nixl_xfer_s"] for r in runs if r.get("nixl_xfer_s")]
        if pulls:
            samples.append((int(length) * kv_bytes_per_token, statistics.median(pulls)))
        beyond += [r["d_queue_s"] - r["nixl_xfer_s"] for r in runs
                   if r.get("nixl_xfer_s") and r.get("d_queue_s") is not None]
    if not samples:
        raise ValueError(f"{path}: no nixl probes with vLLM's pull time (nixl_xfer_s)")
    link = fit_link(sorted(samples), f"vLLM NixlConnector pulls (vllm:nixl_xfer_time_seconds), "
                    f"benchmarks/nixl_side_by_side.py {Path(path).name}")
    return link, (statistics.median(beyond) if beyond else None)
