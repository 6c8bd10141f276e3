"""Where a worker's model comes from, and flags a vLLM user tries that splitserve refuses: a hub
id resolved through an offline hub cache (in a fresh process, as every worker resolves it),
model names checked without resolving them, the model's own length when no --max-model-len is
given, and secret-taking flags refused with the variable to set instead (no vLLM process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.config import WorkerConfig
from splitserve.hub import check_model_name, download_ignore_patterns
from splitserve.launch.config import DeploymentConfig
from splitserve.secretflags import check_passthrough, secret_flag_of
from splitserve.worker.launch import worker_command
from tests.support.scripted import closed_port
from tests.support.workers import hub_cache

SECRET = "s3cr3t-value"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

RESOLVE = """
import json, sys
from splitserve.hub import resolve_model
out = []
for model, rev in json.loads(sys.argv[1]):
    try:
        src = resolve_model(model, rev)
        out.append({"path": src.path, "name": src.name})
    except ValueError as exc:
        out.append({"error": str(exc)})
print(json.dumps(out))
"""


def resolve_offline(hf_home: Path, *cases: tuple[str, str | None],
                    endpoint: str | None = None) -> list[dict]:
    """`resolve_model` on each (model, revision) in a process whose environment is a user's:
    HF_HOME names the cache, HF_HUB_OFFLINE=1 forbids the network (`endpoint`: it is allowed,
    and the hub is at that address)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(hf_home)} | (
        {"HF_ENDPOINT": endpoint} if endpoint else {"HF_HUB_OFFLINE": "1"})
    out = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert "Retrying" not in out.stderr  # an unreachable hub is asked once, not with backoff
    return json.loads(out.stdout)


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(llama_ckpt: Path, tmp_path: Path
                                                          ) -> None:
    snapshot = hub_cache(tmp_path / "hf", "org/name", llama_ckpt, COMMIT)
    by_main, by_commit, other_rev, other_repo, local = resolve_offline(
        tmp_path / "hf", ("org/name", None), ("org/name", COMMIT), ("org/name", "v2"),
        ("org/other", None), (str(llama_ckpt), None))
    assert by_main == by_commit == {"path": str(snapshot), "name": "org/name"}
    assert (Path(by_main["path"]) / "model.safetensors").is_file()
    for missing in (other_rev, other_repo):
        assert "not in the Hugging Face cache" in missing["error"]
        assert "HF_HUB_OFFLINE" in missing["error"]
    assert "v2" in other_rev["error"]
    assert local == {"path": str(llama_ckpt), "name": None}  # a directory is served as itself
    # a hub that does not answer, or answers 503: the cache serves, as offline
    with unwell_hub() as unwell:
        for endpoint in (f"http://127.0.0.1:{closed_port()}", unwell):
            by_main, missing = resolve_offline(tmp_path / "hf", ("org/name", None),
                                               ("org/other", None), endpoint=endpoint)
            assert by_main == {"path": str(snapshot), "name": "org/name"}
            assert "the hub cannot be reached" in missing["error"]


@contextmanager
def unwell_hub() -> Iterator[str]:
    """A hub that answers every request with 503 (its URL)."""
    class Unwell(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Unwell)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_model_names_are_checked_without_resolving(tmp_path: Path) -> None:
    check_model_name(str(tmp_path))
    check_model_name("Qwen/Qwen2.5-0.5B-Instruct", "main")
    for bad, message in (("/no/such/dir", "does not exist"), ("./rel/dir", "does not exist"),
                         ("org/na me", "neither a directory nor")):
        with pytest.raises(ValueError, match=message):
            check_model_name(bad)
    with pytest.raises(ValueError, match="revision"):
        check_model_name(str(tmp_path), "main")
    assert DeploymentConfig(colocated=1, model="org/name", revision="v1").model == "org/name"
    with pytest.raises(ValueError, match="revision"):
        DeploymentConfig(colocated=1, revision="v1")


def test_a_download_takes_one_weight_format() -> None:
    both = ["config.json", "model.safetensors", "pytorch_model.bin", "original/consolidated.pth"]
    skip = download_ignore_patterns(both)
    assert "*.bin" in skip and "*.safetensors" not in skip and "original/*" in skip
    assert "*.bin" not in download_ignore_patterns(["config.json", "pytorch_model.bin"])


def test_the_models_own_length_unless_a_flag_gives_one() -> None:
    argv, _ = worker_command(WorkerConfig(model="m", port=8000), None)
    assert "--max-model-len" not in argv  # vLLM derives the model's own length
    argv, _ = worker_command(WorkerConfig(model="m", port=8000, max_model_len=4096), None)
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    with pytest.raises(ValueError, match="max_model_len"):
        WorkerConfig(model="m", port=8000, max_model_len=0)
    assert DeploymentConfig(colocated=1).max_model_len is None


@pytest.mark.parametrize("argv, names", [
    (["worker", "--embedded", "--port", "8000", "--api-key", SECRET], "SPLITSERVE_API_KEY"),
    (["worker", "--embedded", "--port", "8000", "--api-key=" + SECRET], "SPLITSERVE_API_KEY"),
    (["serve", "--colocated", "1", "--api-key", SECRET], "SPLITSERVE_API_KEY"),
    (["router", "--colocated", "http://127.0.0.1:1", "--api-key", SECRET], "SPLITSERVE_API_KEY"),
    (["worker", "--embedded", "--port", "8000", "--token", SECRET], "SPLITSERVE_TOKEN"),
    (["serve", "--colocated", "1", "--hf-token", SECRET], "HF_TOKEN"),
])
def test_secret_flags_name_the_variable(argv: list[str], names: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and names in err
    assert "unrecognized arguments" not in err and SECRET not in err


@pytest.mark.parametrize("command", [["worker", "--port", "8000"], ["serve", "--colocated", "1"]])
def test_secret_flags_passed_through_to_vllm_are_refused(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--model", str(tmp_path), "--", "--api-key", SECRET]) == 2
    err = capsys.readouterr().err
    assert "SPLITSERVE_API_KEY" in err and "after `--`" in err and SECRET not in err


@pytest.mark.parametrize("passed, refused", [
    ("--api-key", "--api-key"), ("--api-k=" + SECRET, "--api-key"), ("--hf-tok", "--hf-token"),
    ("--tok", "--token"), ("--tokenizer", None), ("--max-model-len", None), ("-t", None),
])
def test_abbreviations_vllm_would_expand_to_a_secret_flag_are_refused(
        passed: str, refused: str | None) -> None:
    assert secret_flag_of(passed) == refused
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            check_passthrough(["--dtype", "float32", passed])
