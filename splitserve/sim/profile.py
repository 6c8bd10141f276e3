"""`splitserve profile`: measure a running vLLM worker through its OpenAI API and fit the cost
model (`model.py`).

Requests go through the benchmark's streaming client (`splitserve.bench.client.run_stream`), so
TTFT and inter-token gaps are measured exactly as the benchmark measures them, with random
token-id prompts (no prefix-cache hits) and `ignore_eos`.

- Prefill: one request at a time, `max_tokens=1`, over a grid of prompt lengths; TTFT is the
  time of the whole prefill as a client sees it. With the worker's token budget, a prompt of l
  tokens runs as ⌈l/budget⌉ chunks, so the fit is `TTFT = a·chunks + b·l + c·l²` — the
  simulator's chunk cost summed over a prompt.
- Decode: B concurrent requests with prompt L; in the window where all B are decoding (after the
  last first token, before the first finish) every gap is one decode step at batch B and total
  context ≈ B·(L + tokens so far). One row per (B, L) — medians — fitted to `a + b·ctx + c·B`.
- KV capacity and the step budget come from the worker's `/metrics`
  (`vllm:cache_config_info`) and the caller (vLLM does not expose `max_num_batched_tokens`).
- Transfer links (`sim.links.measured_links`): from the connector benchmark's JSON, or a
  loopback TCP probe of this host, with `probe_nixl` a `nixl` link from NIXL READs between two
  local agents (`sim.nixl_probe`), and with `probe_mooncake` a `mooncake` link from Mooncake
  transfer-engine WRITEs between two local engines (`sim.mooncake_probe`), each labelled with
  what it measured.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from splitserve.bench.client import ClientConfig, RequestRecord, run_stream
from splitserve.bench.runsheet import hardware
from splitserve.bench.workload import Request
from splitserve.common.modelconfig import kv_shape, read_config
from splitserve.config import bearer_headers, load_token
from splitserve.sim.calibration.jitter import noise_bins, window_jitter
from splitserve.sim.costmodel import DecodeCost, PrefillCost
from splitserve.sim.links import measured_links
from splitserve.sim.model import VLLM_CPU_TOKEN_BUDGET, Engine, ModelShape, Profile

MIN_LEVEL_POINTS = 3  # a batch's level (`fit_decode(levels=True)`): a median of this many or more
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure. Lengths beyond the worker's max_model_len are dropped."""

    prefill_lens: tuple[int, ...] = (16, 64, 256, 512, 1024, 1536, 2048, 3072)
    prefill_repeats: int = 3
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_prompt_lens: tuple[int, ...] = (32, 512, 1536)
    decode_tokens: int = 32
    token_budget: int = VLLM_CPU_TOKEN_BUDGET  # the worker's max_num_batched_tokens
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.prefill_lens) < 3 or min(self.prefill_lens) < 1:
            raise ValueError("need at least 3 positive prefill lengths to fit 3 parameters")
        if len(self.decode_batches) * len(self.decode_prompt_lens) < 3:
            raise ValueError("need at least 3 (batch, prompt) decode points")
        if self.prefill_repeats < 1 or self.decode_tokens < 8 or self.token_budget < 1:
            raise ValueError("prefill_repeats >= 1, decode_tokens >= 8, token_budget >= 1")


def _prompt(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(10, 500, size=n))


def _run(url: str, requests: list[Request], concurrency: int | None) -> list[RequestRecord]:
    # A splitserve worker requires the deployment token (from the environment) on every path.
    cfg = ClientConfig(url, api_key=load_token(required=False), run_tag="profile")
    recs, _ = asyncio.run(run_stream(cfg, requests, concurrency))
    bad = [r for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"profiling request failed: {bad[0].error_cause}: {bad[0].error}")
    return recs


def chunk_features(length: int, budget: int) -> tuple[float, float, float]:
    """(chunks, Σq, Σ(q² + 2pq)) for one prompt split by the token budget."""
    chunks = math.ceil(length / budget)
    return float(chunks), float(length), float(length) ** 2


def nnls(x: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    """Least squares with non-negative coefficients (few columns: try every active set), of
    *relative* error by default, so short prompts and small batches count as much as long ones;
    `relative=False` for absolute error."""
    xw, yw = (x / y[:, None], np.ones_like(y)) if relative else (x, y)
    best, best_err = np.zeros(x.shape[1]), float("inf")
    for mask in range(1, 2 ** x.shape[1]):
        cols = [i for i in range(x.shape[1]) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(x.shape[1])
        full[cols] = coef
        err = float(((xw @ full - yw) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    return best


def robust_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    """Fit, then drop points more than 3× the median relative residual off (at most a fifth of
    them: a shared machine's hiccups) and fit again. Reports the relative residuals."""
    coef = nnls(x, y)
    rel = np.abs(x @ coef / y - 1)
    keep = np.ones(len(y), dtype=bool)
    limit = 3 * max(float(np.median(rel)), 0.02)
    worst = np.argsort(-rel)[: len(y) // 5]
    keep[[i for i in worst if rel[i] > limit]] = False
    if not keep.all() and keep.sum() >= x.shape[1]:
        coef = nnls(x[keep], y[keep])
    rel = x @ coef / y - 1
    return coef, {"dropped": [int(i) for i in np.flatnonzero(~keep)],
                  "median_abs_rel_error": float(np.median(np.abs(rel[keep]))),
                  "max_abs_rel_error": float(np.abs(rel[keep]).max())}


def fit_prefill(points: list[tuple[int, float]], budget: int
                ) -> tuple[PrefillCost, dict[str, Any]]:
    x = np.array([chunk_features(n, budget) for n, _ in points])
    coef, quality = robust_fit(x, np.array([t for _, t in points]))
    return PrefillCost(*map(float, coef)), quality


def fit_decode(points: list[tuple[int, float, float]], levels: bool = False
               ) -> tuple[DecodeCost, dict[str, Any]]:
    """points: (batch, total context, step seconds). With `levels`, each batch measured at
    least `MIN_LEVEL_POINTS` times also gets its median residual off the linear fit (over the
    points the fit kept) as its `batch_levels` entry."""
    x = np.array([[1.0, c, b] for b, c, _ in points])
    y = np.array([t for *_, t in points])
    coef, quality = robust_fit(x, y)
    linear = DecodeCost(float(coef[0]), float(coef[1]), float(coef[2]))
    if not levels:
        return linear, quality
    resid: dict[int, list[float]] = {}
    for i, (b, c, t) in enumerate(points):
        if i not in quality["dropped"]:
            resid.setdefault(b, []).append(t - linear.time(b, c))
    lv = tuple((b, statistics.median(r)) for b, r in sorted(resid.items())
               if len(r) >= MIN_LEVEL_POINTS)
    cost = replace(linear, batch_levels=lv)
    rel = [abs(cost.time(b, c) / t - 1) for i, (b, c, t) in enumerate(points)
           if i not in quality["dropped"]]
    return cost, quality | {"levels_ms": {str(b): round(s * 1e3, 3) for b, s in lv},
                            "median_abs_rel_error_levels": float(np.median(rel))}


def measure_prefill(url: str, plan: ProfilePlan, max_len: int) -> list[tuple[int, float]]:
    rng = np.random.default_rng(plan.seed)
    lens = [n for n in plan.prefill_lens if n + 1 < max_len]
    reqs = [Request(i, 0.0, _prompt(rng, n), 1)
            for i, n in enumerate(n for n in lens for _ in range(plan.prefill_repeats))]
    recs = _run(url, reqs, concurrency=1)
    by_len: dict[int, list[float]] = {}
    for req, rec in zip(reqs, recs, strict=True):
        by_len.setdefault(req.input_len, []).append(rec.chunk_times[0] - rec.send_s)
    return [(n, statistics.median(ts)) for n, ts in sorted(by_len.items())]


def decode_window(recs: list[RequestRecord], prompt_len: int, start: float | None = None
                  ) -> tuple[float, float] | None:
    """(median seconds per decode step, median total context) while all B requests decode: the
    window from `start` (default: the last first token) to the first last token. Per request,
    the time between its first and last chunk inside the window over the tokens in between —
    robust to chunks that carry several tokens (a server that falls behind coalesces them).
    Without such a window, each request's whole decode span."""
    if start is None:
        start = max(r.chunk_times[0] for r in recs)
    end = min(r.chunk_times[-1] for r in recs)
    b = len(recs)
    steps, ctxs = [], []
    for r in recs:
        inside = [i for i, t in enumerate(r.chunk_times) if start <= t <= end]
        if len(inside) < 2:
            continue
        i0, i1 = inside[0], inside[-1]
        tokens = sum(r.chunk_tokens[i0 + 1:i1 + 1])
        if tokens < 2:
            continue
        steps.append((r.chunk_times[i1] - r.chunk_times[i0]) / tokens)
        done = sum(r.chunk_tokens[:i0 + 1]) + tokens / 2  # tokens generated mid-window
        ctxs.append(b * (prompt_len + done))
    if not steps:  # no common window (tiny models stream in bursts): whole decode spans
        for r in recs:
            tokens = sum(r.chunk_tokens[1:])
            if tokens >= 2:
                steps.append((r.chunk_times[-1] - r.chunk_times[0]) / tokens)
                ctxs.append(b * (prompt_len + r.chunk_tokens[0] + tokens / 2))
    if not steps:
        return None
    return statistics.median(steps), statistics.median(ctxs)


def decode_points(plan: ProfilePlan, max_len: int) -> list[tuple[int, int]]:
    """The (prompt length, batch) points of the decode grid that fit in `max_len`."""
    return [(L, b) for L in plan.decode_prompt_lens
            if L + plan.decode_tokens + 1 <= max_len for b in plan.decode_batches]


def measure_decode(url: str, plan: ProfilePlan, max_len: int,
                   progress: Callable[[], None] | None = None
                   ) -> tuple[list[tuple[int, float, float]], list[float]]:
    """(batch, context, step seconds) rows, and the windows' gap jitter (seconds);
    `progress` is called after each point of the grid."""
    rng = np.random.default_rng(plan.seed + 1)
    rows, jitter = [], []
    for L, b in decode_points(plan, max_len):
        reqs = [Request(i, 0.0, _prompt(rng, L), plan.decode_tokens) for i in range(b)]
        recs = _run(url, reqs, concurrency=None)
        got = decode_window(recs, L)
        if got is not None:
            rows.append((b, got[1], got[0]))
            jitter += window_jitter(recs)
        if progress is not None:
            progress()
    return rows, jitter


def worker_facts(url: str) -> dict[str, Any]:
    """Engine version, served model (and its local path), max_model_len and KV capacity."""
    base = url.rstrip("/")
    token = load_token(required=False)
    with httpx.Client(timeout=30.0,
                      headers=bearer_headers(token)) as c:
        version = c.get(f"{base}/version").json().get("version", "unknown")
        model = c.get(f"{base}/v1/models").json()["data"][0]
        metrics = c.get(f"{base}/metrics").text
    facts: dict[str, Any] = {"version": version, "model": model["id"],
                             "root": model.get("root"),
                             "max_model_len": model.get("max_model_len") or 8192}
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:
                                                          line.rindex("}")].split(","))
            labels = {k: v.strip('"') for k, v in labels.items()}
            facts["kv_capacity_tokens"] = (int(labels["num_gpu_blocks"])
                                           * int(labels["block_size"]))
            facts["block_size"] = int(labels["block_size"])
    return facts


def shape_from_config(model_dir: str | Path, name: str) -> ModelShape:
    cfg = read_config(model_dir)
    kv = kv_shape(cfg)
    return ModelShape(name=name, layers=kv.layers, kv_heads=kv.kv_heads, head_dim=kv.head_dim,
                      dtype_bytes=_DTYPE_BYTES.get(str(cfg.get("torch_dtype", "float32")), 4),
                      latent=kv.latent)


def nixl_desc_bytes(shape: ModelShape, block_size: int) -> int:
    """The bytes of one KV block of one layer's K (or V): one NIXL descriptor on vLLM-CPU, and
    one entry of a MooncakeConnector write."""
    return block_size * shape.kv_heads * shape.head_dim * shape.dtype_bytes


def profile_worker(url: str, plan: ProfilePlan, model_dir: str | None = None,
                   transfer_json: str | None = None, probe_tcp: bool = True,
                   probe_nixl: bool = False, probe_mooncake: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> Profile:
    """Measure a running worker's prefill and decode costs on `plan`'s grid and fit them.
    `progress(done, total)` is called as the grid's steps end (the prefill grid is one step,
    each decode point one more)."""
    facts = worker_facts(url)
    root = model_dir or facts.get("root")
    if not root or not (Path(root) / "config.json").is_file():
        raise ValueError("cannot find the model's config.json: pass --model-dir")
    shape = shape_from_config(root, facts["model"])
    max_len = int(facts["max_model_len"])
    total, done = 1 + len(decode_points(plan, max_len)), [0]

    def step() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    pre = measure_prefill(url, plan, max_len)
    step()
    dec, jitter = measure_decode(url, plan, max_len, step)
    prefill, qp = fit_prefill(pre, plan.token_budget)
    decode, qd = fit_decode(dec)
    desc = nixl_desc_bytes(shape, int(facts.get("block_size", 128)))
    links = measured_links(transfer_json, probe_tcp, desc if probe_nixl else None,
                           desc if probe_mooncake else None)
    return Profile(
        kind="measured", engine=Engine("vllm", str(facts["version"])), model=shape,
        hardware=hardware() | {"measured_url": url}, prefill=prefill, decode=decode,
        token_budget=plan.token_budget,
        kv_capacity_tokens=int(facts.get("kv_capacity_tokens", 10**6)), transfer=links,
        fit={"prefill_points": [[n, t] for n, t in pre], "prefill_fit": qp,
             "decode_points": [[b, c, t] for b, c, t in dec], "decode_fit": qd,
             "jitter_ms": [round(j * 1e3, 3) for j in jitter],  # behind gap_jitter_s
             "plan": {"prefill_lens": list(plan.prefill_lens),
                      "decode_batches": list(plan.decode_batches),
                      "decode_prompt_lens": list(plan.decode_prompt_lens),
                      "decode_tokens": plan.decode_tokens}},
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        gap_jitter_s=noise_bins(jitter),
    )


def refit(profile: Profile) -> Profile:
    """The same measurements fitted again (e.g. after a change to the fitting method)."""
    if profile.kind != "measured" or "prefill_points" not in profile.fit:
        raise ValueError("only a measured profile with its points can be refitted")
    pre = [(int(n), float(t)) for n, t in profile.fit["prefill_points"]]
    dec = [(int(b), float(c), float(t)) for b, c, t in profile.fit["decode_points"]]
    prefill, qp = fit_prefill(pre, profile.token_budget)
    decode, qd = fit_decode(dec)
    return replace(profile, prefill=prefill, decode=decode,
                   fit=profile.fit | {"prefill_fit": qp, "decode_fit": qd})
