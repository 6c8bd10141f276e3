"""TLS on the KV channel: configuration is validated and carried as paths only; a TLS listener
takes TLS pushers and control clients, and refuses plain clients, untrusted certificates, wrong
host names and (mutual TLS) clients without a certificate before any KV moves; a real P/D pair
with TLS produces Hugging Face's greedy tokens."""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from splitserve.config import ConnectorConfig, WorkerConfig
from splitserve.connector.faults import Faults
from splitserve.connector.framing import ProtocolError, recv_exact_into
from splitserve.connector.listener import KVListener
from splitserve.connector.messages import Query
from splitserve.connector.protocol import Fingerprint, connect, query
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats
from splitserve.connector.tls import TlsStream, client_context, server_context
from splitserve.connector.transport.base import PushChannel
from splitserve.connector.transport.shm import ShmPushChannel
from splitserve.connector.transport.tcp import TcpPushChannel
from splitserve.launch import cli as serve_cli
from splitserve.launch.config import from_mapping, load_yaml
from splitserve.launch.local import LocalDeployment
from splitserve.worker import cli as worker_cli
from splitserve.worker.launch import worker_command
from tests.support import cores
from tests.support.channels import FP, SHAPE, assert_staged_equals, push, settle
from tests.support.tlscerts import Pki, make_pki
from tests.support.workers import (
    TEST_SPECS,
    Worker,
    auth_headers,
    hf_greedy,
    launch_together,
    running,
    transfer_record,
    two_legs,
)
from tests.support.workers import TOKEN as WORKER_TOKEN

TOKEN = "tls-test-token-0123456789"


@dataclass(frozen=True)
class Pkis:
    good: Pki  # 127.0.0.1 / localhost, signed by the deployment's CA
    stranger: Pki  # same hosts, another CA
    elsewhere: Pki  # the deployment's CA, but for another host


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> Pkis:
    root = tmp_path_factory.mktemp("pki")
    good, ca = make_pki(root, "kv")
    stranger, _ = make_pki(root, "stranger")
    elsewhere, _ = make_pki(root, "elsewhere", ("elsewhere.example",), ca_from=ca)
    return Pkis(good, stranger, elsewhere)


# -- configuration -----------------------------------------------------------------------------
def test_connector_config_is_validated(pkis: Pkis) -> None:
    g = pkis.good
    for bad, message in (({"tls_cert": g.cert}, "go together"),
                         ({"tls_key": g.key}, "go together"),
                         ({"tls_ca": g.ca}, "needs tls_cert"),
                         ({"tls_cert": g.cert, "tls_key": "/no/such.key"}, "no such file")):
        with pytest.raises(ValueError, match=message):
            ConnectorConfig(**bad)  # type: ignore[arg-type]
    assert not ConnectorConfig().tls_enabled and g.config().tls_enabled
    assert server_context(ConnectorConfig()) is None and client_context(ConnectorConfig()) is None
    ctx = server_context(g.config())
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED  # a CA makes it mutual
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    client = client_context(g.config())
    assert client is not None and client.check_hostname
    mismatched = ConnectorConfig(tls_cert=g.cert, tls_key=pkis.stranger.key)
    with pytest.raises(ValueError, match="cannot load certificate"):
        server_context(mismatched)


def test_only_paths_travel_in_vllm_config(pkis: Pkis) -> None:
    g = pkis.good
    cfg = WorkerConfig(model="m", port=8000, role="decode", kv_port=9000, kv_tls_cert=g.cert,
                       kv_tls_key=g.key, kv_tls_ca=g.ca)
    argv, _ = worker_command(cfg, WORKER_TOKEN)
    raw = argv[argv.index("--kv-transfer-config") + 1]
    assert "PRIVATE KEY" not in raw and "BEGIN" not in raw and g.key in raw
    extra = json.loads(raw)["kv_connector_extra_config"]
    assert ConnectorConfig.from_extra_config(extra) == cfg.connector_config()
    assert cfg.connector_config().tls_ca == g.ca
    with pytest.raises(ValueError, match="plain worker"):
        WorkerConfig(model="m", port=8000, kv_tls_cert=g.cert, kv_tls_key=g.key)
    with pytest.raises(ValueError, match="kv_tls_cert and kv_tls_key go together"):
        WorkerConfig(model="m", port=8000, role="decode", kv_port=9000, kv_tls_cert=g.cert)


def test_worker_and_serve_flags(pkis: Pkis, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    g = pkis.good
    monkeypatch.chdir(Path(g.cert).parent)
    p = argparse.ArgumentParser()
    worker_cli.add_worker_arguments(p)
    args = p.parse_args(["--model", str(tmp_path), "--port", "8000", "--role", "prefill",
                         "--kv-port", "9000", "--kv-tls-cert", Path(g.cert).name,
                         "--kv-tls-key", g.key, "--kv-tls-ca", g.ca])
    cfg = worker_cli.config_from_args(args, [])
    assert (cfg.kv_tls_cert, cfg.kv_tls_key, cfg.kv_tls_ca) == (g.cert, g.key, g.ca)  # absolute

    sub = argparse.ArgumentParser().add_subparsers()
    serve_cli.register(sub)
    serve = sub.choices["serve"].parse_args(["--prefill", "1", "--decode", "1", "--colocated",
                                             "1", "--kv-tls-cert", g.cert, "--kv-tls-key", g.key,
                                             "--kv-tls-ca", g.ca])
    dep = serve_cli.config_from_args(serve)
    planned = dict(LocalDeployment(dep).plan_workers())
    assert {n: w.kv_tls_cert for n, w in planned.items()} == {
        "prefill0": g.cert, "decode1": g.cert, "colocated2": None}  # one cert for all
    assert planned["decode1"].connector_config().tls_ca == g.ca

    yaml = tmp_path / "d.yaml"
    yaml.write_text(f"prefill: 1\ndecode: 1\nkv_tls_cert: {g.cert}\nkv_tls_key: {g.key}\n")
    assert load_yaml(yaml).kv_tls_key == g.key and load_yaml(yaml).kv_tls_ca is None
    with pytest.raises(ValueError, match="no prefill|has none"):
        from_mapping({"colocated": 1, "kv_tls_cert": g.cert, "kv_tls_key": g.key})
    with pytest.raises(ValueError, match="no such file"):
        from_mapping({"prefill": 1, "decode": 1, "kv_tls_cert": "/nope", "kv_tls_key": g.key})


# -- the channel, in one process ---------------------------------------------------------------
@pytest.fixture
def tls_listener(pkis: Pkis) -> Iterator[tuple[KVListener, StagingArea]]:
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {"echo": q.to_wire()},
                     server_context(pkis.good.config()))
    yield lis, staging
    lis.close()
    staging.close()


def tls_channel(kind: str, port: int, ctx: ssl.SSLContext | None) -> PushChannel:
    cls = TcpPushChannel if kind == "tcp" else ShmPushChannel
    return cls("127.0.0.1", port, TOKEN, FP, ConnectorStats(), Faults(False), SHAPE, 1.0,
               tls=ctx)


def assert_nothing_staged(staging: StagingArea, tid: str) -> None:
    assert staging.state()["staged_bytes"] == 0 and staging.final_status(tid) is None


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_tls_push_arrives_intact(tls_listener: tuple[KVListener, StagingArea], pkis: Pkis,
                                 kind: str) -> None:
    lis, staging = tls_listener
    torch.manual_seed(2)
    caches = [torch.randn(8, 2, 64, 64) for _ in range(2)]
    blocks, chunks = (3, 0, 7, 5, 1), [(0, 130), (130, 300)]  # > one TLS record per layer
    ch = tls_channel(kind, lis.port, client_context(pkis.good.config()))
    push(ch, f"tls-{kind}", caches, blocks, chunks)
    assert settle(ch, f"tls-{kind}") == "complete"
    st = staging.claim(f"tls-{kind}")
    assert st is not None and st.complete
    assert_staged_equals(staging, st, caches, blocks, chunks)
    staging.release(st, "loaded")
    ch.close()
    # the control channel shares the port, so it speaks TLS too
    assert query("127.0.0.1", lis.port, TOKEN, Query("state"), 2.0,
                 client_context(pkis.good.config())) == {"echo": {"what": "state"}}
    sock, _ = connect("127.0.0.1", lis.port, TOKEN, "control", None, 2.0,
                      client_context(pkis.good.config()))
    with sock:
        assert sock.version() in ("TLSv1.2", "TLSv1.3")  # type: ignore[union-attr]


def test_plain_client_is_refused(tls_listener: tuple[KVListener, StagingArea]) -> None:
    lis, staging = tls_listener
    with pytest.raises((OSError, ProtocolError)):
        query("127.0.0.1", lis.port, TOKEN, Query("state"), 1.0)
    ch = tls_channel("tcp", lis.port, None)
    push(ch, "plain", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "plain") == "failed"
    ch.close()
    with socket.create_connection(("127.0.0.1", lis.port), timeout=5) as s:
        s.sendall(b"SS\x0a\x00\x00\x00\x02{}")  # a BEGIN frame where a ClientHello belongs
        heard = b""
        while chunk := s.recv(100):
            heard += chunk
        assert not heard.startswith(b"SS")  # closed without a word of the KV protocol
    assert_nothing_staged(staging, "plain")


def test_untrusted_certificate_is_refused(tls_listener: tuple[KVListener, StagingArea],
                                          pkis: Pkis) -> None:
    lis, staging = tls_listener
    stranger = client_context(pkis.stranger.config())  # trusts another CA
    with pytest.raises(ssl.SSLCertVerificationError):
        connect("127.0.0.1", lis.port, TOKEN, "push", FP, 2.0, stranger)
    ch = tls_channel("tcp", lis.port, stranger)
    push(ch, "stranger", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
    assert settle(ch, "stranger") == "failed"
    assert ch.poll("stranger").record.cause == "tls_failed"  # type: ignore[union-attr]
    ch.close()
    assert_nothing_staged(staging, "stranger")


def test_wrong_host_name_is_refused(pkis: Pkis) -> None:
    staging = StagingArea(2 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {},
                     server_context(pkis.elsewhere.config()))  # trusted CA, other host
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch|hostname"):
            connect("127.0.0.1", lis.port, TOKEN, "push", FP, 2.0,
                    client_context(pkis.good.config()))
    finally:
        lis.close()
        staging.close()


def test_mutual_tls_needs_a_client_certificate(tls_listener: tuple[KVListener, StagingArea],
                                               pkis: Pkis) -> None:
    lis, staging = tls_listener
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.load_verify_locations(pkis.good.ca)  # trusts the listener, presents nothing
    with pytest.raises((ssl.SSLError, ProtocolError, OSError)):
        connect("127.0.0.1", lis.port, TOKEN, "push", FP, 2.0, anonymous)
    # the token is still checked inside TLS
    with pytest.raises(ProtocolError, match="authentication failed"):
        connect("127.0.0.1", lis.port, "not-the-token", "push", FP, 2.0,
                client_context(pkis.good.config()))
    assert staging.state()["staged_bytes"] == 0


def test_tls_pusher_never_falls_back_to_plain(pkis: Pkis) -> None:
    staging = StagingArea(2 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    plain = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {})
    try:
        ch = tls_channel("tcp", plain.port, client_context(pkis.good.config()))
        push(ch, "downgrade", [torch.randn(2, 2, 64, 64)] * 2, (0,), [(0, 10)])
        assert settle(ch, "downgrade") == "failed"
        assert ch.poll("downgrade").record.cause == "tls_failed"  # type: ignore[union-attr]
        ch.close()
        assert_nothing_staged(staging, "downgrade")
    finally:
        plain.close()
        staging.close()


def test_full_duplex_stream_keeps_bytes_in_order(pkis: Pkis) -> None:
    """One thread writes while another reads on the same TLS connection (a push channel's
    sender and its ACK reader): an echo of 8 MiB comes back byte for byte."""
    a, b = socket.socketpair()
    srv_ctx, cli_ctx = server_context(pkis.good.config()), client_context(pkis.good.config())
    assert srv_ctx is not None and cli_ctx is not None
    data = torch.randint(0, 256, (8 * 1024**2,), dtype=torch.uint8).numpy().tobytes()

    def echo() -> None:
        with TlsStream(b, srv_ctx, server_side=True) as srv:
            buf = bytearray(100_000)
            while n := srv.recv_into(memoryview(buf)):
                srv.sendall(memoryview(buf)[:n])

    server = threading.Thread(target=echo, daemon=True)
    server.start()
    cli = TlsStream(a, cli_ctx, server_side=False, server_hostname="localhost")
    writer = threading.Thread(target=cli.sendall, args=(data,), daemon=True)
    writer.start()
    back = bytearray(len(data))
    recv_exact_into(cli, memoryview(back))
    writer.join(10)
    cli.shutdown(socket.SHUT_RDWR)
    cli.close()
    server.join(10)
    assert bytes(back) == data


# -- a real P/D pair over TLS ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_pair(llama_ckpt: Path, pkis: Pkis) -> Iterator[tuple[Worker, Worker]]:
    g = pkis.good
    tls = {"kv_tls_cert": g.cert, "kv_tls_key": g.key, "kv_tls_ca": g.ca}
    p, d = launch_together(llama_ckpt, ("tls-p", "prefill", {"cpus": cores.PREFILL, **tls}),
                           ("tls-d", "decode", {"cpus": cores.DECODE, **tls}))
    with running(p, d):
        yield p, d


def test_tls_pair_matches_transformers(tls_pair: tuple[Worker, Worker], llama_ckpt: Path
                                       ) -> None:
    p, d = tls_pair
    assert TEST_SPECS["llama"].num_layers == 2
    prompt = [(7 * i + 3) % 1000 + 1 for i in range(150)]
    tokens, _, rd = two_legs(p, d, prompt, 12, "tls-e2e", transport="tcp")
    assert rd is not None and rd.status_code == 200
    assert tokens == hf_greedy(llama_ckpt, prompt, 12)
    recv = transfer_record(d, "tls-e2e")["recv"]
    assert recv["status"] == "loaded" and recv["tokens"] == len(prompt)
    # the plugin's routes and metrics reach the connector over TLS
    assert d.state()["kv_tls"] is True and p.state()["kv_tls"] is True
    metrics = httpx.get(f"{d.url}/metrics", headers=auth_headers(), timeout=10).text
    assert "splitserve_kv_listener_up 1.0" in metrics
    # a plain client (right token, right model) gets nothing from D's port
    fp = d.state()["model_fingerprint"]
    with pytest.raises((OSError, ProtocolError)):
        connect("127.0.0.1", d.kv_port, WORKER_TOKEN, "push", Fingerprint(**fp), 2.0)
    assert d.state()["staged_bytes"] == 0
