"""`splitserve worker`: configuration, the pinned vLLM check, and where the token may travel."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import uuid
from importlib import metadata
from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.common import engine
from splitserve.common.cpus import parse_cpus
from splitserve.common.privatedir import MAX_IPC_PATH, WORKER_DIR_ENV, remove_worker_dir
from splitserve.common.vocab import Connector, Role
from splitserve.config import TOKEN_ENV, TOKEN_FILE_ENV, WorkerConfig, load_token
from splitserve.worker.kv_transfer import kv_buffer_device
from splitserve.worker.kvrelay import KV_EVENTS_DIR_ENV, events_config
from splitserve.worker.launch import (
    WorkerProcess,
    check_vllm_version,
    free_port,
    worker_command,
)
from tests.support.workers import TOKEN, Worker


def test_parse_cpus() -> None:
    assert parse_cpus("0,1") == (0, 1)
    assert parse_cpus("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpus("4, 1") == (4, 1)
    for bad, why in [("1-", "not a core list"), ("", "not a core list"), ("-1", "not a core"),
                     ("0,x", "not a core list"), ("5-4", "runs backwards"),
                     ("0-3,2-5", r"core\(s\) 2-3 given twice"), ("1,1", "given twice")]:
        with pytest.raises(ValueError, match=why):
            parse_cpus(bad)


def test_a_bad_core_list_is_refused_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--colocated", "1", "--cpus", "0-1,1"])
    assert exit_.value.code == 2
    assert "argument --cpus: core(s) 1 given twice" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [
    {"role": "middle"}, {"transport": "udp"}, {"port": 0}, {"dtype": "int8"},
    {"cpus": ()}, {"role": "decode", "kv_port": 0}, {"on_transfer_failure": "ignore"},
])
def test_config_is_validated(bad: dict) -> None:
    base = {"model": "m", "port": 8000, "role": "decode", "kv_port": 9000}
    with pytest.raises(ValueError):
        WorkerConfig(**(base | bad))


def test_token_travels_only_in_the_environment() -> None:
    cfg = WorkerConfig(model="m", port=8000, role="prefill", kv_port=9000, cpus=(1,))
    argv, env = worker_command(cfg, TOKEN)
    assert TOKEN not in " ".join(argv)
    kv_config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert TOKEN not in json.dumps(kv_config)
    assert kv_config["kv_load_failure_policy"] == "recompute"
    assert kv_config["kv_connector_module_path"] == "splitserve.connector.vllm"
    assert env[TOKEN_ENV] == TOKEN
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_nixl_worker_runs_vllms_nixl_connector_on_its_own_side_channel() -> None:
    cfg = WorkerConfig(model="m", port=8000, role="decode", kv_port=9123, connector="nixl",
                       lease_s=25.0, cpus=(1,), nixl_progress_delay_us=500)
    argv, env = worker_command(cfg, TOKEN)
    kv_config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv_config["kv_connector"] == "NixlConnector" and kv_config["kv_role"] == "kv_both"
    assert kv_config["kv_buffer_device"] == kv_buffer_device()
    assert kv_config["kv_connector_module_path"] == "splitserve.worker.nixl"
    extra = kv_config["kv_connector_extra_config"]
    assert extra["kv_lease_duration"] == 25
    assert extra["splitserve_nixl"] == {"role": "decode", "progress_delay_us": 500,
                                        "keep_affinity": True}
    assert (env["VLLM_NIXL_SIDE_CHANNEL_HOST"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (
        "127.0.0.1", "9123")
    assert TOKEN not in json.dumps(kv_config)
    with pytest.raises(ValueError, match="connector"):
        WorkerConfig(model="m", port=8000, role="decode", kv_port=9000, connector="lmcache")


def test_nixl_module_keeps_vllms_class_name() -> None:
    """vLLM checks `has_connector("NixlConnector")` by name; the loaded class is vLLM's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from splitserve.worker.nixl import NixlConnector

    assert NixlConnector.__name__ == "NixlConnector"
    assert issubclass(NixlConnector, NixlPullConnector)


def test_progress_delay_reaches_the_agent_and_is_undone() -> None:
    """nixl's Python API builds agents with a zero delay (a spinning progress thread); inside
    `progress_delay` the binding builds them with ours, and outside it is untouched."""
    from splitserve.worker.nixl import progress_delay

    api = pytest.importorskip("nixl._api")
    built: list[int] = []
    real = api.nixlBind.nixlAgent

    class Config:
        pthrDelay = 0

    with progress_delay(750):
        wrapped = api.nixlBind.nixlAgent
        assert wrapped is not real
    assert api.nixlBind.nixlAgent is real
    # the wrapper hands the binding the config with our delay set
    try:
        api.nixlBind.nixlAgent = lambda name, config: built.append(config.pthrDelay)
        with progress_delay(750):
            api.nixlBind.nixlAgent("a", Config())
    finally:
        api.nixlBind.nixlAgent = real
    assert built == [750]


def test_plain_worker_has_no_connector() -> None:
    argv, env = worker_command(WorkerConfig(model="m", port=8000), None)
    assert "--kv-transfer-config" not in argv


def test_token_from_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / "token").write_text("from-a-file\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    assert load_token() == "from-a-file"
    monkeypatch.delenv(TOKEN_FILE_ENV)
    with pytest.raises(ValueError, match="no deployment token"):
        load_token()
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the deployment token"):
        load_token(required=False)


def test_a_token_that_cannot_be_had_is_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, "/nonexistent/token")
    port = str(free_port())
    for argv in (["serve", "--prefill", "1", "--decode", "1", "--port", port],
                 ["router", "--colocated", "http://127.0.0.1:1", "--port", port]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith(
            f"splitserve {argv[0]}: {TOKEN_FILE_ENV}: cannot read the deployment token")
    monkeypatch.delenv(TOKEN_FILE_ENV)
    assert main(["worker", "--role", "prefill", "--embedded", "--port", port]) == 2
    assert capsys.readouterr().err.startswith("splitserve worker: no deployment token")


def test_pinned_vllm_release(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                             ) -> None:
    assert check_vllm_version() == "0.32.0"
    monkeypatch.setattr(engine.metadata, "version", lambda dist: "0.31.1")
    with pytest.raises(RuntimeError, match="pinned to vLLM 0.32.0, but vLLM 0.31.1 is installed"):
        check_vllm_version()
    assert main(["worker", "--model", "m", "--port", "8000"]) == 2
    assert "pinned to vLLM 0.32.0" in capsys.readouterr().err

    def missing(dist: str) -> str:
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(engine.metadata, "version", missing)
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        check_vllm_version()


def test_running_worker_keeps_the_token_out_of_logs_and_argv(
        llama_pair: tuple[Worker, Worker]) -> None:
    for w in llama_pair:
        assert TOKEN not in w.log.read_text()
        for pid in [w.proc.pid, *children(w.proc.pid)]:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            assert TOKEN.encode() not in cmdline


def test_a_running_workers_vllm_sockets_are_in_its_private_directory(
        llama_pair: tuple[Worker, Worker]) -> None:
    """vLLM's processes talk over Unix sockets named by a uuid4: a worker's are all in its
    private directory (removed with it), none in the system's temporary directory."""
    for w in llama_pair:
        assert isinstance(w.proc, WorkerProcess)
        directory = Path(w.proc.worker_env[WORKER_DIR_ENV])
        own = [p for p in directory.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
        assert any(is_uuid(p.name) for p in own), sorted(p.name for p in own)
        for pid in [w.proc.pid, *children(w.proc.pid)]:  # each process's bound sockets
            for path in bound_unix_sockets(pid):
                assert not is_uuid(Path(path).name) or Path(path).parent == directory, path


def is_uuid(name: str) -> bool:
    try:
        return str(uuid.UUID(name)) == name
    except ValueError:
        return False


def bound_unix_sockets(pid: int) -> set[str]:
    """The paths of the Unix sockets `pid` holds (its inodes looked up in /proc/net/unix)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            paths.add(fields[7])
    return paths


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().split()
            except OSError:
                continue
            if int(stat[3]) == pid:
                out += [int(entry), *children(int(entry))]
    return out


def test_vllm_output_is_read_to_its_end_when_our_stdout_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`splitserve worker | head`: once the reader leaves, vLLM's output is still drained (a
    full pipe would block vLLM) and its last lines are still kept for the start-up diagnosis."""
    from collections import deque
    from io import BytesIO

    from splitserve.worker.cli import _pump

    class GoneBuffer:
        writes = 0

        def write(self, data: bytes) -> int:
            GoneBuffer.writes += 1
            raise BrokenPipeError

        def flush(self) -> None:
            raise BrokenPipeError

    class GoneStdout:
        buffer = GoneBuffer()

    monkeypatch.setattr("sys.stdout", GoneStdout())
    lines = [f"line {i}\n".encode() for i in range(50)]
    tail: deque[bytes] = deque(maxlen=10)
    _pump(BytesIO(b"".join(lines)), tail)
    assert list(tail) == lines[-10:]
    assert GoneBuffer.writes == 1


def test_nixl_registers_kv_on_the_gpu_unless_vllms_cpu_build_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_buffer_device() == "cpu"  # this machine runs vllm-cpu

    def no_cpu_build(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", no_cpu_build)
    assert kv_buffer_device() == "cuda"


@pytest.mark.parametrize(("host", "advertised"), [
    ("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("0.0.0.0", None), ("::", None),
    ("worker-7.internal", None)])
def test_vllms_own_queues_advertise_the_address_the_worker_binds(
        monkeypatch: pytest.MonkeyPatch, host: str, advertised: str | None) -> None:
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    _, env = worker_command(WorkerConfig(model="m", port=8000, host=host), None)
    assert env.get("VLLM_HOST_IP") == advertised
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.9.9")  # the operator's own choice wins
    _, env = worker_command(WorkerConfig(model="m", port=8000, host=host), None)
    assert env["VLLM_HOST_IP"] == "10.9.9.9"


@pytest.mark.parametrize(("role", "connector"), [
    (Role.PREFILL, Connector.SPLITSERVE), (Role.DECODE, Connector.NIXL),
    (None, Connector.SPLITSERVE)])
def test_every_worker_publishes_its_kv_events_on_a_private_socket(
        role: Role | None, connector: Connector) -> None:
    cfg = WorkerConfig(model="m", port=8000, role=role, kv_port=9000 if role else 0,
                       connector=connector)
    argv, env = worker_command(cfg, TOKEN)
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    directory = env[KV_EVENTS_DIR_ENV]
    assert events == events_config(directory)
    assert events["endpoint"].startswith("ipc://") and "tcp" not in json.dumps(events)
    assert os.stat(directory).st_mode & 0o777 == 0o700


def test_kv_events_need_the_token_and_can_be_turned_off() -> None:
    argv, env = worker_command(WorkerConfig(model="m", port=8000), None)
    assert "--kv-events-config" not in argv and KV_EVENTS_DIR_ENV not in env
    argv, env = worker_command(WorkerConfig(model="m", port=8000, kv_events=False), TOKEN)
    assert "--kv-events-config" not in argv and KV_EVENTS_DIR_ENV not in env


@pytest.mark.parametrize("kv_events", [True, False])
def test_vllms_own_sockets_go_in_the_workers_private_directory(kv_events: bool,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """vLLM's processes talk over Unix sockets it names under `VLLM_RPC_BASE_PATH` and leaves
    behind when killed: each worker's go in its private directory, removed with the worker."""
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/tmp")  # the operator's is replaced
    _, env = worker_command(WorkerConfig(model="m", port=8000, kv_events=kv_events), TOKEN)
    directory = env[WORKER_DIR_ENV]
    assert env["VLLM_RPC_BASE_PATH"] == directory and os.path.isdir(directory)
    assert env.get(KV_EVENTS_DIR_ENV) == (directory if kv_events else None)
    # vLLM's own names (a uuid4) fit a Unix socket path there
    assert len(f"{directory}/{uuid.uuid4()}") <= MAX_IPC_PATH
    remove_worker_dir(env)
    assert not os.path.exists(directory)


@pytest.mark.parametrize("arg", ["--kv-events-config", "--kv-events-config={}",
                                 "--kv_events_config", "--kv-events", "--kv-events-config.topic"])
def test_a_users_own_kv_events_config_is_refused_unless_ours_is_off(arg: str) -> None:
    with pytest.raises(ValueError, match="--no-kv-events"):
        WorkerConfig(model="m", port=8000, extra_args=(arg, "{}"))
    cfg = WorkerConfig(model="m", port=8000, kv_events=False, extra_args=(arg, "{}"))
    argv, _ = worker_command(cfg, TOKEN)
    assert argv[-2:] == [arg, "{}"]


@pytest.mark.parametrize("arg", ["--kv-cache-memory-bytes", "--kv-cache-memory-bytes=8G",
                                 "--kv_cache_memory_bytes", "--kv-cache-mem"])
def test_a_kv_size_vllms_cpu_build_would_ignore_is_refused_naming_kv_cache_gib(arg: str
                                                                               ) -> None:
    from splitserve.launch.config import from_mapping

    with pytest.raises(ValueError, match="give --kv-cache-gib instead"):
        WorkerConfig(model="m", port=8000, extra_args=(arg, "8G"))
    with pytest.raises(ValueError, match="give --kv-cache-gib instead"):
        from_mapping({"colocated": 1, "worker_args": [arg, "8G"]})
    # other --kv-cache-* flags pass
    WorkerConfig(model="m", port=8000, extra_args=("--kv-cache-dtype", "auto"))


def test_no_kv_events_flag_reaches_the_worker_and_the_deployment(tmp_path: Path) -> None:
    import argparse

    from splitserve.launch import cli as serve_cli
    from splitserve.launch.config import from_mapping
    from splitserve.launch.local import LocalDeployment
    from splitserve.worker import cli as worker_cli

    p = argparse.ArgumentParser()
    worker_cli.add_worker_arguments(p)
    on = p.parse_args(["--model", str(tmp_path), "--port", "8000"])
    off = p.parse_args(["--model", str(tmp_path), "--port", "8000", "--no-kv-events"])
    assert worker_cli.config_from_args(on, []).kv_events
    assert not worker_cli.config_from_args(off, []).kv_events

    sub = argparse.ArgumentParser().add_subparsers()
    serve_cli.register(sub)
    serve = sub.choices["serve"]
    dep = serve_cli.config_from_args(serve.parse_args(["--colocated", "1"]))
    assert dep.kv_events
    dep = serve_cli.config_from_args(serve.parse_args(["--colocated", "1", "--no-kv-events"]))
    assert not dep.kv_events
    assert not any(w.kv_events for _, w in LocalDeployment(dep).plan_workers())
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 1\ndecode: 1\ncpus: [0, 1]\nkv_events: false\n")
    dep = serve_cli.config_from_args(serve.parse_args(["--config", str(f)]))
    assert [w.kv_events for _, w in LocalDeployment(dep).plan_workers()] == [False, False]
    with pytest.raises(ValueError, match="--no-kv-events"):
        from_mapping({"colocated": 1, "worker_args": ["--kv-events-config", "{}"]})
    assert from_mapping({"colocated": 1, "kv_events": False,
                         "worker_args": ["--kv-events-config", "{}"]}).worker_args
