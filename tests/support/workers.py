"""Test helpers: small random checkpoints, real vLLM workers on loopback, HF references.

Shared by every test package. Workers are real `splitserve worker` processes (vLLM's OpenAI
server with splitserve's connector); start-up costs ~30 s, so fixtures share them widely.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import httpx

from splitserve.common.procs import stop_groups
from splitserve.config import WorkerConfig, bearer_headers
from splitserve.demo_model import ModelSpec, build_checkpoint
from splitserve.worker.launch import free_port, start_worker, wait_healthy
from tests.support.integration import starts_processes

TOKEN = "splitserve-test-token-0123456789abcdef"
LOG_DIR = Path(os.environ.get("SPLITSERVE_TEST_LOGS", "/tmp/splitserve-test-logs"))
# Every worker `launch` started and nobody stopped or killed yet (the drain check's set).
LIVE: set[Worker] = set()

# Small shapes keep start-up and prefill fast; a wide initializer keeps greedy decoding free of
# near-tied logits (no position is skipped in the comparisons).
# Workers start with each model's own length (2,048 positions here), as vLLM does.
TEST_SPECS = {
    "llama": ModelSpec(arch="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       max_position_embeddings=2048, seed=1),
}
# Mixture-of-experts families (4 experts of 128, top 2), each with its dense sibling's attention
# (Qwen2's QKV bias and tied embeddings; Qwen3's q/k norms, here on one KV head of 64): their
# KV is standard, so the connector carries it as it carries Llama's.
_MOE = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 128, "num_layers": 2,
        "num_heads": 4, "max_position_embeddings": 2048, "num_experts": 4}
TEST_SPECS["mixtral"] = ModelSpec(arch="mixtral", num_kv_heads=2, head_dim=32, seed=5, **_MOE)
TEST_SPECS["qwen2_moe"] = ModelSpec(arch="qwen2_moe", num_kv_heads=2, head_dim=32, seed=6,
                                    extra={"tie_word_embeddings": True}, **_MOE)
TEST_SPECS["qwen3_moe"] = ModelSpec(arch="qwen3_moe", num_kv_heads=1, head_dim=64, seed=7,
                                    **_MOE)
# DeepSeek-V2: multi-head latent attention (one 576-wide latent a token and layer, vLLM-CPU's
# MLA backend) and MoE with a shared expert after a dense first layer
TEST_SPECS["deepseek_v2"] = ModelSpec(arch="deepseek_v2", num_kv_heads=4, head_dim=32, seed=8,
                                      **_MOE)
# GQA with 4 KV heads (8 query heads): two KV heads a rank at tensor parallelism 2.
TEST_SPECS["llama-kv4"] = replace(TEST_SPECS["llama"], num_heads=8, num_kv_heads=4, seed=9)
# The llama test model with attention's output scaled down: its greedy output repeats itself,
# so n-gram speculative decoding has drafts to accept (tests/worker/test_speculative.py).
TEST_SPECS["llama-repeats"] = replace(TEST_SPECS["llama"], attention_out_scale=0.003)
# The llama test model's weights with 32,768 positions (a long-context model's config).
TEST_SPECS["llama-32k"] = replace(TEST_SPECS["llama"], max_position_embeddings=32768)
# One sequence of its 131,072 positions needs 2 GiB of KV (16 KiB a token): more than 1 GiB.
TEST_SPECS["llama-128k-wide-kv"] = ModelSpec(
    arch="llama", vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=8,
    num_heads=4, num_kv_heads=4, head_dim=64, max_position_embeddings=131072, seed=4)


def make_checkpoint(root: Path, name: str) -> Path:
    """The checkpoint of `TEST_SPECS[name]` under `root` (built once)."""
    out = root / name
    if not (out / "model.safetensors").exists():
        build_checkpoint(out, TEST_SPECS[name])
    return out


def hub_cache(hf_home: Path, repo_id: str, checkpoint: Path, commit: str) -> Path:
    """A Hugging Face hub cache under `hf_home` holding `checkpoint` as `repo_id` at `commit`,
    laid out as the hub's downloads are (`hub/models--org--name/snapshots/<commit>/`, with
    `refs/main` naming the commit). Returns the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@dataclass(eq=False)  # compared (and hashed) by identity: one object per started process
class Worker:
    cfg: WorkerConfig
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def kv_port(self) -> int:
        return self.cfg.kv_port

    def state(self) -> dict:
        r = httpx.get(f"{self.url}/splitserve/state", headers=auth_headers(), timeout=5)
        r.raise_for_status()
        return r.json()

    def kv_usage(self) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=auth_headers(), timeout=5).text
        for line in text.splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("worker exports no vllm:kv_cache_usage_perc")

    @property
    def has_connector_state(self) -> bool:
        """The worker runs splitserve's connector (it serves `/splitserve/state`)."""
        return self.cfg.role is not None and self.cfg.connector == "splitserve"

    def drain_state(self) -> tuple[int, int, int, float]:
        """(staged bytes, pending loads, held sends, KV usage): all zero once drained. A worker
        without splitserve's connector (plain, NIXL) has only its KV usage to show. The
        worker's `/splitserve/state` sums its tensor-parallel ranks (checked against
        `rank_states` in tests/connector/test_tp.py)."""
        if not self.has_connector_state:
            return 0, 0, 0, self.kv_usage()
        s = self.state()
        return s["staged_bytes"], s["pending_loads"], s["held_sends"], self.kv_usage()

    def rank_states(self) -> list[dict]:
        """Each tensor-parallel rank's connector state, from the rank's own KV listener
        (`kv_port + rank`)."""
        from splitserve.connector.messages import Query
        from splitserve.connector.protocol import query

        return [query(self.cfg.host, self.kv_port + r, TOKEN, Query("state"))
                for r in range(self.cfg.tensor_parallel_size)]

    def stop(self) -> None:
        stop_all(self)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (vLLM's EngineCore with it), as a crash."""
        LIVE.discard(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def stop_all(*workers: Worker) -> None:
    """Stop the workers side by side: SIGTERM to every group, then up to 20 s for all of them to
    exit (each shuts down as it would alone), then SIGKILL to what is left."""
    for w in workers:
        LIVE.discard(w)
    stop_groups([w.proc for w in workers], 20.0)


def auth_headers() -> dict[str, str]:
    return bearer_headers(TOKEN)


def metric_sum(worker: Worker, *names: str) -> float:
    """The sum of every sample named exactly one of `names` (any labels) on the worker's
    /metrics. Exactly: `vllm:num_requests_waiting` must not take in the samples of
    `vllm:num_requests_waiting_by_reason`, which count the same requests again."""
    text = httpx.get(f"{worker.url}/metrics", headers=auth_headers(), timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] in names)


@starts_processes
def launch(model: Path, name: str, role: str | None, env: dict[str, str] | None = None,
           **overrides: object) -> Worker:
    """Start one worker and wait until it is healthy. It is in `LIVE` until stopped or killed:
    after every integration test, each live worker must drain (tests/conftest.py)."""
    ranks = int(overrides.get("tensor_parallel_size", 1))  # type: ignore[call-overload]
    cfg = WorkerConfig(model=str(model), port=free_port(), role=role,  # type: ignore[arg-type]
                       kv_port=free_port(count=ranks) if role else 0,  # a KV port a rank
                       staging_bytes=64 * 1024**2)
    cfg = replace(cfg, **overrides)  # type: ignore[arg-type]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}-{cfg.port}.log"
    proc = start_worker(cfg, TOKEN, str(log), extra_env=env)
    worker = Worker(cfg, proc, log)
    try:
        wait_healthy(cfg.url, proc, timeout_s=600, token=TOKEN, log=log)
    except BaseException:
        worker.stop()
        raise
    LIVE.add(worker)
    return worker


@starts_processes
def launch_together(model: Path, *specs: tuple[str, str | None, dict[str, object]]
                    ) -> list[Worker]:
    """Start several workers side by side (`(name, role, overrides)` each, as `launch` takes
    them) and wait until all are healthy; if one fails, the others are stopped."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(launch, model, name, role, **overrides)
                   for name, role, overrides in specs]
        wait_futures(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(futures):
        stop_all(*started)
        next(f.result() for f in futures if f.exception() is not None)  # raises its error
    return started


@contextlib.contextmanager
def running(*workers: Worker) -> Iterator[tuple[Worker, ...]]:
    try:
        yield workers
    finally:
        stop_all(*workers)


def wait_drained(*workers: Worker, timeout_s: float = 15.0) -> None:
    """Assert every worker returns to zero within `timeout_s`: no staged KV, no pending loads,
    no held sends, no KV blocks in use (`Worker.drain_state`)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, tuple[int, int, int, float]] = {}
    while True:
        last = {w.url: w.drain_state() for w in workers}
        if all(v == (0, 0, 0, 0.0) for v in last.values()):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise AssertionError(f"workers did not drain in {timeout_s} s "
                         f"(staged bytes, pending loads, held sends, kv usage): {last}")


@lru_cache(maxsize=4)
def _hf_model(model_dir: str):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def chat_prompt_ids(model: str | Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt token ids vLLM builds for a chat request: the model's chat template with the
    generation prompt, through its own tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation (float32, no stop on EOS): the reference."""
    import torch

    model = _hf_model(str(model_dir))
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values,
                        use_cache=True)
    return out


def model_name(worker: Worker) -> str:
    r = httpx.get(f"{worker.url}/v1/models", headers=auth_headers(), timeout=10)
    return str(r.json()["data"][0]["id"])


def two_legs(p: Worker, d: Worker, prompt: list[int], max_tokens: int, transfer_id: str,
             transport: str = "tcp", skip: int = 0
             ) -> tuple[list[int], httpx.Response, httpx.Response | None]:
    """Drive the two legs by hand: prefill leg to P (max_tokens 1), decode leg to D with
    prompt + [t1]. `skip`: P pushes only the prompt's tokens after the first `skip` (D's prefix
    cache is expected to hold them), as the router asks when it predicts D's cache. Returns
    (all generated tokens, P's response, D's response)."""
    name = model_name(p)
    params: dict[str, object] = {"do_remote_decode": True, "transfer_id": transfer_id,
                                 "remote_host": "127.0.0.1", "remote_port": d.kv_port,
                                 "transport": transport}
    if skip:
        params["skip_tokens"] = skip
    if d.cfg.tensor_parallel_size > 1:  # as the router says it, from D's fingerprint
        params["remote_tp"] = d.cfg.tensor_parallel_size
    body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True, "kv_transfer_params": params}
    rp = httpx.post(f"{p.url}/v1/completions", json=body, headers=auth_headers(), timeout=120)
    rp.raise_for_status()
    t1 = rp.json()["choices"][0]["token_ids"][0]
    if max_tokens == 1:
        return [t1], rp, None
    decode_params = {"do_remote_prefill": True, "transfer_id": transfer_id}
    p_tp = (rp.json().get("kv_transfer_params") or {}).get("prefill_tp")
    if p_tp:  # P's ranks, which D must hear from, as the router hands them on
        decode_params["prefill_tp"] = p_tp
    body = {"model": name, "prompt": prompt + [t1], "max_tokens": max_tokens - 1,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "kv_transfer_params": decode_params}
    rd = httpx.post(f"{d.url}/v1/completions", json=body, headers=auth_headers(), timeout=120)
    if rd.status_code != 200:
        return [t1], rp, rd
    return [t1] + rd.json()["choices"][0]["token_ids"], rp, rd


def split_at_once(p: Worker, d: Worker, prompts: list[list[int]], max_tokens: int,
                  transport: str, tag: str) -> list[tuple[list[int], str, dict]]:
    """Every prompt through `two_legs` at once, each under a fresh transfer id: asserts D
    answered and the tokens equal transformers' on P's checkpoint. Returns (prompt, transfer
    id, D's receive record) per prompt, in order."""
    ids = [f"{tag}-{transport}-{uuid.uuid4().hex}" for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda a: two_legs(p, d, a[0], max_tokens, a[1], transport),
                                zip(prompts, ids, strict=True)))
    ckpt = Path(p.cfg.model)
    out = []
    for prompt, tid, (tokens, _, rd) in zip(prompts, ids, results, strict=True):
        assert rd is not None and rd.status_code == 200, rd and rd.text
        assert tokens == hf_greedy(ckpt, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
        recv = find_record(d, tid)
        # no BEGIN reached D: P's record says why
        assert recv is not None, f"D never saw transfer {tid}; P's record: {find_record(p, tid)}"
        out.append((prompt, tid, recv["recv"]))
    return out


def whole_answer(worker: Worker, prompt: list[int], max_tokens: int) -> list[int]:
    """The worker's greedy tokens for `prompt`, served whole (no kv_transfer_params)."""
    r = httpx.post(f"{worker.url}/v1/completions", headers=auth_headers(), timeout=120, json={
        "model": model_name(worker), "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def find_record(worker: Worker, transfer_id: str) -> dict | None:
    """The worker's record of a transfer, or None if it has none (404)."""
    r = httpx.get(f"{worker.url}/splitserve/transfers/{transfer_id}", headers=auth_headers(),
                  timeout=5)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def transfer_record(worker: Worker, transfer_id: str) -> dict:
    rec = find_record(worker, transfer_id)
    assert rec is not None, f"{worker.url} has no record of transfer {transfer_id}"
    return rec
