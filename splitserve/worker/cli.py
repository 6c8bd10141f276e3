"""`splitserve worker`: one vLLM server in a role, with splitserve's connector configured.

vLLM runs as this process's child, in a session of its own: each SIGINT and SIGTERM is passed
on to it, its output passes through unchanged, it is killed if this process dies, and its exit
status is ours. Once it exits, whatever is left of its process group (vLLM's engine process) is
SIGKILLed, and the private directory `worker_command` made for it is removed. When it fails to
start for a reason one of our flags fixes (a KV cache too small for the model's length), a last
line says which (`splitserve.worker.diagnose`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from types import FrameType
from typing import IO

from splitserve.common.cpus import check_cpus_usable, cpus_flag
from splitserve.common.guard import GRACE_ENV, guarded
from splitserve.common.ports import check_port_free
from splitserve.common.privatedir import remove_worker_dir
from splitserve.common.refusal import refusing
from splitserve.common.vocab import Connector, Role, values
from splitserve.config import (
    FAILURE_POLICIES,
    IDLE_SPIN_S,
    MIN_IDLE_SPIN_S,
    NIXL_PROGRESS_DELAY_US,
    TRANSPORTS,
    WorkerConfig,
    load_token,
)
from splitserve.connector.tls import client_context, server_context
from splitserve.hub import check_model_dir
from splitserve.secretflags import add_secret_guards, check_passthrough
from splitserve.worker.diagnose import explain_start_failure
from splitserve.worker.kv_transfer import check_mooncake_installed, check_nixl_installed
from splitserve.worker.launch import (
    check_kv_fits,
    check_vllm_version,
    child_preexec,
    free_port,
    gpu_connector_warning,
    worker_command,
)

TAIL_LINES = 400  # of vLLM's output, kept to explain a failed start
# how long the output is still read once the group is gone (a process that left the group may
# hold the pipe open; the pump is a daemon, and the exit ends it)
PUMP_DRAIN_S = 5.0


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """`--kv-tls-*`: TLS on the KV channel (file paths; relative ones resolved here)."""
    p.add_argument("--kv-tls-cert", type=os.path.abspath, default=None, metavar="PEM",
                   help="encrypt the KV channel: certificate the connector's listener presents "
                        "(and presents as a client), valid for --host")
    p.add_argument("--kv-tls-key", type=os.path.abspath, default=None, metavar="PEM",
                   help="private key of --kv-tls-cert")
    p.add_argument("--kv-tls-ca", type=os.path.abspath, default=None, metavar="PEM",
                   help="CA bundle that verifies peers; also makes TLS mutual "
                        "(default: the system's CAs, listener does not ask for client certs)")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="model directory, or Hugging Face model id (org/name)")
    model.add_argument("--embedded", action="store_true",
                       help="serve the embedded demo model (generated on first use)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face model id (default: main)")
    p.add_argument("--role", choices=values(Role), default=None,
                   help="prefill, decode or both; omit for plain vLLM (no connector)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cpus", type=cpus_flag, default=None, help="cores, e.g. 0,1 or 0-3")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: N ranks of one engine, --cpus split evenly across "
                        "them (fewer cores than ranks: the ranks share them; default 1)")
    p.add_argument("--kv-port", type=int, default=0,
                   help="connector port, NIXL's side-channel port with --connector nixl, "
                        "P's bootstrap port with --connector mooncake (default: a free one)")
    p.add_argument("--connector", choices=values(Connector), default=Connector.SPLITSERVE.value,
                   help="KV connector: splitserve's own (tcp/shm push), vLLM's NixlConnector "
                        "(D pulls over UCX), or vLLM's MooncakeConnector (D pulls over "
                        "Mooncake's transfer engine)")
    p.add_argument("--mooncake-protocol", choices=("tcp", "rdma"), default=None,
                   help="Mooncake transfer engine's protocol (default: rdma where the machine "
                        "has an RDMA device, else tcp)")
    p.add_argument("--nixl-progress-delay-us", type=int, default=NIXL_PROGRESS_DELAY_US,
                   help="NIXL progress thread's poll timeout (0: nixl's busy spin)")
    p.add_argument("--idle-spin-ms", type=float, default=IDLE_SPIN_S * 1000,
                   help="how long the engine's step queues busy-poll after a read before "
                        "they block (default and least: %(default)g; vLLM's own is 1000, which "
                        "takes a core the worker shares for a second after every step)")
    p.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                   help="splitserve connector's transport (not used by NIXL)")
    p.add_argument("--on-transfer-failure", choices=FAILURE_POLICIES, default="recompute")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="KV cache memory in GiB, each rank's with --tp "
                   "(sets VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt and output (default: the model's own length)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--staging-mib", type=int, default=512, help="decode-side KV staging area")
    p.add_argument("--kv-load-timeout", type=float, default=30.0,
                   help="seconds a decode request waits for its KV before recomputing (or failing)")
    p.add_argument("--kv-lease", type=float, default=60.0,
                   help="seconds staged KV waits for its decode request before it is freed")
    add_speculative_argument(p)
    add_kv_events_argument(p)
    add_tls_arguments(p)
    add_secret_guards(p)


def add_speculative_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding on decode and colocated workers (never prefill), "
                        "vLLM's --speculative-config, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'; a worker "
                        "that loads KV from P takes only methods with no KV of their own "
                        "(ngram, suffix, medusa, mlp_speculator)")


def add_kv_events_argument(p: argparse.ArgumentParser, default: bool | None = True) -> None:
    """`--no-kv-events`: the worker does not report its prefix cache to routers."""
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false", default=default,
                   help="do not publish the engine's KV cache events to routers (by default "
                        "every worker reports the blocks it caches on /splitserve/kv/*, behind "
                        "the deployment token; this also lets a --kv-events-config of your "
                        "own pass to vLLM)")


def config_from_args(args: argparse.Namespace, extra: list[str]) -> WorkerConfig:
    from splitserve.demo_model import embedded_model_dir
    from splitserve.hub import ModelSource, resolve_model

    check_passthrough(extra)
    if not args.idle_spin_ms >= MIN_IDLE_SPIN_S * 1000:  # the flag's own unit, not the field's
        raise ValueError(f"--idle-spin-ms must be at least {MIN_IDLE_SPIN_S * 1000:g}, got "
                         f"{args.idle_spin_ms:g}: shorter busy-poll windows let vLLM's step "
                         "queue miss wake-ups")
    source = (ModelSource(str(embedded_model_dir()), "splitserve-demo") if args.embedded
              else resolve_model(args.model, args.revision))
    kv_port = args.kv_port or (free_port(args.host, args.tp) if args.role else 0)
    return WorkerConfig(
        model=source.path, port=args.port, role=args.role, host=args.host, cpus=args.cpus,
        kv_port=kv_port, connector=args.connector, mooncake_protocol=args.mooncake_protocol,
        nixl_progress_delay_us=args.nixl_progress_delay_us, transport=args.transport,
        idle_spin_s=args.idle_spin_ms / 1000,
        on_transfer_failure=args.on_transfer_failure,
        dtype=args.dtype, kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        served_model_name=source.name,
        staging_bytes=args.staging_mib * 1024**2, load_timeout_s=args.kv_load_timeout,
        lease_s=args.kv_lease, kv_tls_cert=args.kv_tls_cert, kv_tls_key=args.kv_tls_key,
        kv_tls_ca=args.kv_tls_ca, kv_events=args.kv_events,
        speculative_config=args.speculative_config, tensor_parallel_size=args.tp,
        extra_args=tuple(extra),
    )


def run(args: argparse.Namespace) -> int:
    with refusing("worker", RuntimeError):  # another vLLM than the one pinned
        version = check_vllm_version()
    with refusing("worker"):  # every input checked before vLLM starts
        check_cpus_usable(args.cpus)
        check_port_free(args.host, args.port)
        if args.kv_port:
            check_port_free(args.host, args.kv_port, "--kv-port")
        cfg = config_from_args(args, args.vllm_args)
        check_model_dir(cfg.model)
        warning = gpu_connector_warning(cfg.connector, cfg.role is not None)
        if warning:  # a warning, not a refusal: the run that would first verify it
            print(f"splitserve worker: warning: {warning}", file=sys.stderr, flush=True)
        if cfg.role is not None and cfg.connector == Connector.NIXL:
            check_nixl_installed()
        if cfg.role is not None and cfg.connector == Connector.MOONCAKE:
            check_mooncake_installed()
        check_kv_fits(cfg.model, cfg.max_model_len, cfg.kv_cache_gib, cfg.dtype,
                      cfg.extra_args, cfg.tensor_parallel_size)
        # unreadable or mismatched TLS files fail here, not in vLLM
        if cfg.role is not None and cfg.connector == Connector.SPLITSERVE:
            server_context(cfg.connector_config())
            client_context(cfg.connector_config())
        token = load_token(required=cfg.role is not None)
    argv, env = worker_command(cfg, token)
    kv = {Connector.NIXL: f"nixl side channel {cfg.host}:{cfg.kv_port}",
          Connector.MOONCAKE: f"mooncake bootstrap {cfg.host}:{cfg.kv_port}"}.get(
        cfg.connector, f"kv {cfg.transport}://{cfg.host}:{cfg.kv_port}")
    print(f"splitserve worker: vLLM {version}, role={cfg.role or 'plain'}, {cfg.url}"
          + (f", {kv}" if cfg.role else "")
          + (" (TLS)" if cfg.kv_tls_cert else "")
          + (f", tp {cfg.tensor_parallel_size}" if cfg.tensor_parallel_size > 1 else "")
          + (f", cpus {','.join(map(str, cfg.cpus))}" if cfg.cpus else ""), flush=True)
    env[GRACE_ENV] = str(cfg.shutdown_timeout_s + 5)  # the guard's, after vLLM's own drain
    try:  # under a guard: vLLM's engine processes go with it, even when this one is killed
        return supervise(guarded(argv), env, cfg.cpus)
    finally:  # the plugin removes it only after an engine that came up
        remove_worker_dir(env)


def _pump(src: IO[bytes], tail: deque[bytes]) -> None:
    """Pass vLLM's output through while keeping its last lines. Reads to the end even when our
    own stdout is gone (`splitserve worker | head`), so vLLM never blocks on a full pipe."""
    out: IO[bytes] | None = sys.stdout.buffer
    for line in iter(src.readline, b""):
        tail.append(line)
        if out is None:
            continue
        try:
            out.write(line)
            out.flush()
        except (BrokenPipeError, ValueError):
            out = None


def supervise(argv: list[str], env: dict[str, str], cpus: tuple[int, ...] | None) -> int:
    """Run vLLM to its end; return its exit status (128 + signal when a signal ended it).
    `argv` leads a process group of its own; once it has exited, the rest of that group is
    SIGKILLed before its last output is read, so nothing of it outlives this call (an engine
    process would otherwise hold the output pipe, and this call, open)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=child_preexec(cpus), start_new_session=True)

    def forward(signum: int, frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    tail: deque[bytes] = deque(maxlen=TAIL_LINES)
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, tail), daemon=True)
    pump.start()
    code = proc.wait()
    # the group outlives its reaped leader while a member lives, so its id is not reused yet
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    pump.join(PUMP_DRAIN_S)
    if code != 0:
        why = explain_start_failure(b"".join(tail).decode(errors="replace"))
        if why:
            print(f"splitserve worker: {why}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="start one vLLM worker (prefill, decode, both, or plain)",
                       description="Arguments after `--` go to vLLM unchanged.")
    add_worker_arguments(p)
    p.set_defaults(func=run, vllm_args=[])

