"""The peer table of `ray_peer.py`: reads the per-system JSON parts, checks the greedy outputs
against each other and against transformers (float32, the same prompts), prints one table and
writes `ray_peer.json` beside the parts."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from _common import write_json
from _peer_stream import stream_prompts


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations (float32, no stop on EOS): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            res = model(torch.tensor([prompt]), use_cache=True)
            out: list[int] = []
            for _ in range(max_tokens):
                tok = int(res.logits[0, -1].argmax())
                out.append(tok)
                res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values,
                            use_cache=True)
            outs.append(out)
    return outs


def label(part: dict[str, Any]) -> str:
    if part["system"] == "ray-serve-llm":
        return f"Ray Serve LLM PD (batch {part['stream_batching_interval_ms']:g} ms)"
    return "splitserve on Ray"


def _ms(stats: dict[str, float], key: str) -> str:
    return f"{stats[key]:.1f}" if stats else "-"


def report(results: Path, model: str) -> dict[str, Any]:
    parts = sorted((json.loads(p.read_text()) for p in results.glob("ray_peer_*.json")),
                   key=lambda p: (p["system"] != "splitserve", label(p)))
    if not parts:
        raise SystemExit(f"no ray_peer_*.json in {results}: run a --system first")
    ran = [p for p in parts if "stream" in p]
    reference: list[list[int]] = []
    if ran:
        first = ran[0]
        prompts = stream_prompts(first["requests"], first["seed"])
        reference = hf_greedy(model, prompts, first["max_tokens"])
    rows = []
    for part in parts:
        row: dict[str, Any] = {"system": label(part), "startup_s": part.get("startup_s"),
                               "cluster_s": part.get("cluster_s"),
                               "leftovers_killed": part.get("leftovers_killed", [])}
        if "error" in part:
            row["error"] = part["error"]
        if "stream" in part:
            s = part["stream"]
            row.update(ttft=s["ttft"], itl=s["itl"], tpot=s["tpot"],
                       tokens_per_event=sum(map(len, s["outputs"])) / sum(
                           s["events_per_request"]),
                       equal_to_transformers=sum(o == r for o, r in zip(
                           s["outputs"], reference, strict=False)),
                       requests=len(s["outputs"]))
        rows.append(row)
    agree = None
    if len(ran) >= 2:
        outs = [p["stream"]["outputs"] for p in ran]
        agree = {"requests": len(outs[0]),
                 "identical_across_systems": sum(all(o[i] == outs[0][i] for o in outs)
                                                 for i in range(len(outs[0])))}
    print(f"\n{'system':38} {'start s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'TPOT p50':>9} {'= HF':>6}")
    for row in rows:
        if "error" in row:
            print(f"{row['system']:38} did not run: {row['error'][:200]}")
            continue
        print(f"{row['system']:38} {row['startup_s']:>8.1f} {_ms(row['ttft'], 'median_ms'):>9} "
              f"{_ms(row['ttft'], 'p99_ms'):>9} {_ms(row['itl'], 'median_ms'):>8} "
              f"{_ms(row['itl'], 'p99_ms'):>8} {_ms(row['tpot'], 'median_ms'):>9} "
              f"{row['equal_to_transformers']:>3}/{row['requests']}")
    for row in rows:
        left = row["leftovers_killed"]
        if left:
            print(f"{row['system']}: {len(left) if isinstance(left, list) else left} "
                  f"process(es) outlived the cluster's shutdown (killed)")
    if agree is not None:
        print(f"greedy outputs identical across systems: {agree['identical_across_systems']}"
              f"/{agree['requests']} requests")
    out = {"benchmark": "ray_peer", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} "
                      f"cores", "model": model, "rows": rows, "agreement": agree,
           "parts": [p.get("system") for p in parts]}
    write_json(results / "ray_peer.json", out)
    return out
