"""The errors a newcomer meets in the first hour (issue 28, item 6), through the real command:
each is one line `splitserve <cmd>: <what to do>` on stderr, exit status 2 (usage) or 1
(runtime), no traceback, and no vLLM started (every case fails before a worker would start, so
each takes a second or two).

Outside facts are simulated, never splitserve's own code: a PYTHONPATH shim makes `import ray`
or `import nixl` fail as on a machine without them; a GPU is torch's `cuda.is_available`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.config import WorkerConfig
from splitserve.worker import launch
from splitserve.worker.launch import free_port
from tests.support.cli import splitserve_argv

# A config.json alone (no weights): every case below fails before anything loads them.
# 8 layers x 4 KV heads x 64 x float32 x 2 = 16 KiB a token: 131,072 positions need 2 GiB.
WIDE_KV = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
           "head_dim": 64, "max_position_embeddings": 131072, "torch_dtype": "float32"}
SMALL = WIDE_KV | {"max_position_embeddings": 2048}


def model_dir(root: Path, name: str, config: dict) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def blocked(root: Path, *packages: str) -> str:
    """A PYTHONPATH entry where importing each of `packages` fails as if not installed."""
    shim = root / "shim"
    for name in packages:
        (shim / name).mkdir(parents=True)
        (shim / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return str(shim)


def splitserve(*args: str, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """Run `splitserve ARGS` as a user would; the token is set as a deployment has it."""
    full = dict(os.environ) | {"SPLITSERVE_TOKEN": "t" * 32} | (env or {})
    return subprocess.run(splitserve_argv(*args), capture_output=True, text=True, env=full,
                          timeout=120)


def one_line(done: subprocess.CompletedProcess[str], command: str, code: int) -> str:
    """The one error line, after checking the exit status and that nothing else went wrong."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"splitserve {command}: "), done.stderr
    return line


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    port = free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        yield port


def test_no_model(tmp_path: Path) -> None:
    line = one_line(splitserve("serve", "--model", "/no/such/dir", "--colocated", "1",
                               "--port", str(free_port())), "serve", 2)
    assert "model directory '/no/such/dir' does not exist: give the directory" in line
    assert "hub model id" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in ("worker", "serve"):
        line = one_line(splitserve(command, "--model", str(empty), "--port", str(free_port()),
                                   *(["--colocated", "1"] if command == "serve" else [])),
                        command, 2)
        assert f"model directory '{empty}' has no config.json: give the directory" in line
    done = splitserve("worker", "--port", str(free_port()))  # argparse's own error
    assert done.returncode == 2
    assert "one of the arguments --model --embedded is required" in done.stderr


def test_a_hub_id_offline_not_in_the_cache(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for command, code in (("worker", 2), ("serve", 1)):  # serve resolves it as it starts
        done = subprocess.run(
            splitserve_argv(command, "--model", "org/missing", "--port", str(free_port()),
                            *(["--colocated", "1"] if command == "serve" else [])),
            capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr
        line = next(x for x in done.stderr.splitlines() if "org/missing" in x)
        assert line.startswith(f"splitserve {command}: model 'org/missing' (revision main) is "
                               f"not in the Hugging Face cache {tmp_path / 'hf' / 'hub'} on "
                               "this machine"), line
        assert "HF_HUB_OFFLINE is set" in line and "`hf download org/missing`" in line
        assert "set HF_HOME to a cache that holds it" in line


def test_a_port_in_use(taken_port: int, tmp_path: Path) -> None:
    said = f"port {taken_port} on 127.0.0.1 is already in use: stop what listens there, or " \
           "choose another port with --port"
    line = one_line(splitserve("router", "--port", str(taken_port), "--colocated",
                               "http://127.0.0.1:1"), "router", 2)
    assert line.endswith(said)
    line = one_line(splitserve("serve", "--port", str(taken_port), "--colocated", "1"),
                    "serve", 2)
    assert line.endswith(said)
    line = one_line(splitserve("serve", "--port", str(taken_port - 1), "--routers", "2",
                               "--colocated", "1"), "serve", 2)  # the second router's port
    assert line.endswith(said)
    small = str(model_dir(tmp_path, "small", SMALL))
    line = one_line(splitserve("worker", "--model", small, "--port", str(taken_port)),
                    "worker", 2)
    assert line.endswith(said)
    line = one_line(splitserve("worker", "--model", small, "--port", str(free_port()),
                               "--role", "prefill", "--kv-port", str(taken_port)), "worker", 2)
    assert line.endswith("choose another port with --kv-port")


def test_too_little_kv_memory(tmp_path: Path) -> None:
    wide = str(model_dir(tmp_path, "wide", WIDE_KV))
    for command, pool in (("worker", ["--role", "decode"]), ("serve", ["--colocated", "1"])):
        line = one_line(splitserve(command, "--model", wide, "--port", str(free_port()),
                                   "--kv-cache-gib", "1", *pool), command, 2)
        assert ": the KV cache cannot hold one sequence of 131072 tokens" in line
        assert "needs 2.0 GiB of KV cache and --kv-cache-gib (VLLM_CPU_KVCACHE_SPACE) gives " \
               "1.0 GiB; start with --max-model-len 65520 or less" in line
        assert line.endswith("or with --kv-cache-gib 3 or more")
    line = one_line(splitserve("worker", "--model", wide, "--port", str(free_port()),
                               "--max-model-len", "100000"), "worker", 2)
    assert "one sequence of 100000 tokens" in line


def test_the_kv_check_leaves_what_it_cannot_judge_to_vllm(tmp_path: Path) -> None:
    wide = model_dir(tmp_path, "wide", WIDE_KV)
    launch.check_kv_fits(str(wide), 65000, 1, "float32")  # fits
    launch.check_kv_fits(str(wide), None, 1, "bfloat16")  # 1 GiB at 2 bytes
    launch.check_kv_fits(str(wide), None, 1, "float32", ("--kv-cache-dtype", "fp8"))
    sliding = model_dir(tmp_path, "sliding", WIDE_KV | {"sliding_window": 4096})
    launch.check_kv_fits(str(sliding), None, 1, "float32")
    with pytest.raises(ValueError, match="131072 tokens"):
        launch.check_kv_fits(str(wide), None, 1, "auto")  # the checkpoint's float32
    # MLA: one latent of 576 a token and layer (8 x 576 x 4 bytes), not a K and a V
    latent = model_dir(tmp_path, "latent", WIDE_KV | {"kv_lora_rank": 512,
                                                      "qk_rope_head_dim": 64})
    launch.check_kv_fits(str(latent), 50000, 1, "float32")  # 0.86 GiB
    with pytest.raises(ValueError, match="needs 2.25 GiB"):
        launch.check_kv_fits(str(latent), None, 1, "float32")


def test_splitserves_connector_on_a_gpu_machine_is_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said = launch.gpu_connector_warning("splitserve", split=True)
    assert said is not None and said.startswith("this machine has a GPU, and splitserve's own "
                                                "connector (--connector splitserve, the "
                                                "default) has never run on one")
    assert "use --connector nixl" in said and "docs/guides/gpus.md" in said
    assert launch.gpu_connector_warning("nixl", split=True) is None
    assert launch.gpu_connector_warning("splitserve", split=False) is None  # plain workers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.gpu_connector_warning("splitserve", split=True) is None


def test_splitserves_connector_on_a_gpu_machine_through_the_command(tmp_path: Path) -> None:
    """The warning comes first; the command then stops on a KV cache too small (no vLLM)."""
    shim = tmp_path / "gpu"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    wide = str(model_dir(tmp_path, "wide", WIDE_KV))
    args = ("--model", wide, "--port", str(free_port()))
    for command, pool in (("serve", ["--prefill", "1", "--decode", "1"]),
                          ("worker", ["--role", "prefill"])):
        done = splitserve(command, *args, *pool, env={"PYTHONPATH": str(shim)})
        one_line(done, command, 2)
        assert done.stderr.splitlines()[0].startswith(
            f"splitserve {command}: warning: this machine has a GPU"), done.stderr
    done = splitserve("serve", *args, "--colocated", "1", env={"PYTHONPATH": str(shim)})
    assert "warning" not in one_line(done, "serve", 2)  # plain vLLM on a GPU: nothing to say


def test_ray_missing(tmp_path: Path) -> None:
    done = splitserve("serve", "--ray", "--colocated", "1", "--port", str(free_port()),
                      env={"PYTHONPATH": blocked(tmp_path, "ray")})
    line = one_line(done, "serve", 2)
    assert line.endswith("--ray needs Ray (with Ray Serve), which is not installed: "
                         "pip install 'splitserve[ray]'")


def test_nixl_missing(tmp_path: Path) -> None:
    env = {"PYTHONPATH": blocked(tmp_path, "nixl")}
    said = "--connector nixl needs the nixl package, which is not installed: " \
           "pip install 'splitserve[nixl]'"
    small = str(model_dir(tmp_path, "small", SMALL))
    done = splitserve("serve", "--model", small, "--connector", "nixl", "--prefill", "1",
                      "--decode", "1", "--port", str(free_port()), env=env)
    assert one_line(done, "serve", 2).endswith(said)
    done = splitserve("worker", "--model", small, "--connector", "nixl", "--role", "decode",
                      "--port", str(free_port()), env=env)
    assert one_line(done, "worker", 2).endswith(said)


def test_a_latent_attention_model_on_vllm_cpu_runs_the_native_rope(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "kv_buffer_device", lambda: "cpu")  # vLLM-CPU
    latent = str(model_dir(tmp_path, "latent", SMALL | {"kv_lora_rank": 512,
                                                        "qk_rope_head_dim": 64}))
    native = ["--compilation-config", launch.NATIVE_ROPE]
    # AMX's MLA backend cannot load float32 weights: a float32 latent model asks for CPU_MLA
    assert launch.latent_args(latent, "float32", ()) == native + launch.CPU_MLA_BACKEND
    assert launch.latent_args(latent, "bfloat16", ()) == native  # AMX's backend, where there is one
    assert json.loads(launch.NATIVE_ROPE) == {"custom_ops": ["all", "-rotary_embedding"]}
    for own in (("--compilation-config", "{}"), ("-cc.mode=none",), ("-O", "0"), ("-O0",),
                ("--compilation-config.mode=none",)):  # the caller's config, untouched
        assert launch.latent_args(latent, "float32", own) == launch.CPU_MLA_BACKEND
    for own in (("--attention-backend", "TORCH_SDPA"), ("--attention-config", "{}"),
                ("--attention-config.backend=CPU_MLA",)):  # the caller's choice
        assert launch.latent_args(latent, "float32", own) == native
    dense = str(model_dir(tmp_path, "dense", SMALL))
    assert launch.latent_args(dense, "float32", ()) == []
    assert launch.latent_args(str(tmp_path / "a-hub-id"), "float32", ()) == []
    cfg = WorkerConfig(model=latent, port=free_port())
    argv, _ = launch.worker_command(cfg, None)
    assert argv[argv.index("--compilation-config") + 1] == launch.NATIVE_ROPE
    assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
    monkeypatch.setattr(launch, "kv_buffer_device", lambda: "cuda")  # a GPU build: its own rope
    assert launch.latent_args(latent, "float32", ()) == []
