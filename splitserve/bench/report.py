"""What a run shows: progress bar, summary table, result JSON, PNG plots, one HTML report.

Everything here works from result dicts (runner.py), so a report can be rebuilt later from the
JSON files alone (`splitserve bench report a.json b.json --out DIR`).
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import itls_s, prefill_windows, ttft_s
from splitserve.bench.runner import records_of

TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("completed", "completed"), ("failed", "failed"),
    ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"), ("p90_itl_ms", "ITL p90 ms"),
    ("p99_itl_ms", "ITL p99 ms"), ("p999_itl_ms", "ITL p99.9 ms"), ("max_itl_ms", "ITL max ms"),
    ("p99_itl_after_first_ms", "ITL p99 w/o 1st gap ms"),
    ("itl_interference_p50_ratio", "ITL interference p50 (during / outside long prefill)"),
    ("itl_interference_p99_ratio", "ITL interference p99 (during / outside long prefill)"),
    ("median_handover_ms", "handover p50 ms"),
    ("median_kv_transfer_ms", "KV transfer BEGIN->END p50 ms"),
    ("median_kv_tail_ms", "KV exposed tail p50 ms"),
    ("median_d_wait_ms", "D leg -> D's step p50 ms"),
    ("ideal_reuse", "ideal reuse (workload: unbounded single cache)"),
    ("prefix_hit_rate", "prefix hit rate (server-reported)"),
    ("cached_prompt_tokens", "prompt tokens cached (server)"),
    ("computed_prompt_tokens", "prompt tokens computed (server)"),
    ("total_input_tokens", "prompt tokens sent"),
    ("prompt_tokens_computed", "prompt tokens computed (all workers' counters)"),
    ("worker_hit_rate", "hit rate (all workers' prompt tokens)"),
    ("kv_bytes_moved", "KV bytes moved (router)"), ("kv_transfers", "KV transfers (router)"),
    ("prefill_gpu_s", "prefill GPU-seconds (simulated)"),
    ("local_prefills", "prefills on D (router)"),
    ("predicted_cached_tokens", "cached tokens predicted (router, reported legs)"),
    ("reported_cached_tokens", "cached tokens reported (engine)"),
    ("prediction_error", "prediction error |pred - reported| / reported"),
    ("spec_draft_tokens", "draft tokens (speculative decoding)"),
    ("spec_acceptance_rate", "draft acceptance rate"),
    ("spec_accepted_per_draft", "accepted tokens per draft"),
    ("slo_attainment", "SLO attainment"), ("request_goodput", "goodput req/s"),
)


def rate_unit(result: dict[str, Any]) -> str:
    """The unit of a swept result's rates and DistServe goodput (`WorkloadSpec.rate_unit`)."""
    return str((result.get("sweep") or {}).get("rate_unit", "req/s"))


def fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table_rows(results: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    rows = [[label] + [fmt(r.get(key)) for r in results.values()]
            for key, label in TABLE_ROWS if any(r.get(key) is not None for r in results.values())]
    if any(r.get("distserve_goodput") is not None for r in results.values()):
        rows.append(["DistServe goodput"] + [
            "–" if r.get("distserve_goodput") is None
            else f"{fmt(r['distserve_goodput'])} {rate_unit(r)}" for r in results.values()])
    if any(r.get("itl_interference_long_prompts") for r in results.values()):
        rows.append(["ITL gaps during / outside long prefill"] + [
            f"{r.get('itl_interference_during_count', '–')} / "
            f"{r.get('itl_interference_outside_count', '–')}" for r in results.values()])
    rows.append(["long-prompt TTFT p50 ms"] + [
        fmt(r.get("by_kind", {}).get("long", {}).get("median_ttft_ms"))
        for r in results.values()])
    rows.append(["stream digest"] + [
        str(r.get("run_sheet", {}).get("stream", {}).get("digest", "–"))[:8]
        for r in results.values()])
    if any(r.get("prompt_tokens_by_source") for r in results.values()):
        rows.append(["prompt tokens computed / cache-hit / loaded (per worker)"] + [
            " ; ".join(" / ".join(f"{v.get(k, 0):.0f}" for k in ("computed", "cache_hit", "loaded"))
                       for v in r.get("prompt_tokens_by_source", {}).values()) or "–"
            for r in results.values()])
    if any(r.get("prompt_tokens_by_role") for r in results.values()):
        rows.append(["prompt tokens computed / cache-hit / loaded, hit rate (per role)"] + [
            " ; ".join(f"{role} " + " / ".join(f"{v.get(k, 0):.0f}" for k in (
                "computed", "cache_hit", "loaded")) + f", {fmt(v.get('hit_rate'))}"
                for role, v in r.get("prompt_tokens_by_role", {}).items()) or "–"
            for r in results.values()])
    for key, label in (("busy_fraction", "busy fraction"), ("queued_fraction", "queued fraction")):
        rows.append([f"{label} (per worker)"] + [
            " / ".join(fmt(v) for v in r.get(key, {}).values()) or "–" for r in results.values()])
    return rows


def print_summary(results: Mapping[str, dict[str, Any]], verdict_line: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="splitserve bench")
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")
    for row in table_rows(results):
        table.add_row(*row)
    console = Console()
    console.print(table)
    for name, r in results.items():
        if r.get("errors"):
            console.print(f"[red]{name}: errors by cause {r['errors']}[/red]")
    if verdict_line:
        console.print(verdict_line)


@contextmanager
def progress_bars() -> Iterator[Callable[[str, int], Callable[[RequestRecord], None]]]:
    """A rich progress display; yields a factory: (system, total) → per-request callback."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        def factory(system: str, total: int) -> Callable[[RequestRecord], None]:
            task = progress.add_task(system, total=total)
            return lambda _rec: progress.advance(task)
        yield factory


def _clean(obj: Any) -> Any:
    """NaN/inf → None so that the JSON is strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    """Write a result dict as strict JSON (NaN and infinities become null)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(result), indent=1, allow_nan=False))
    return p


# ---- plots -------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_itl_over_time(results: Mapping[str, dict[str, Any]], path: Path) -> Path:
    """One panel per system: each chunk gap at its arrival time; the long prompts' prefill
    windows ([send, first token], as the interference ratio counts them) shaded."""
    plt = _plt()
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), sharex=True,
                             sharey=True,
                             squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items(), strict=True):
        recs = records_of(res)
        xs = [t for r in recs for t in r.chunk_times[1:] if r.ok]
        ys = [g * 1000 for r in recs for g in itls_s(r)]
        ax.scatter(xs, ys, s=3, alpha=0.5, label="chunk gap")
        for i, (start, end) in enumerate(prefill_windows(recs)):
            ax.axvspan(start, end, color="red", alpha=0.15, lw=0,
                       label="long prompt's prefill (send to first token)" if i == 0 else None)
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(name, fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time since run start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_cdf(results: Mapping[str, dict[str, Any]], metric: str, path: Path) -> Path:
    """CDF of pooled ITL (`metric="itl"`) or per-request TTFT (`metric="ttft"`), in ms."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, res in results.items():
        recs = records_of(res)
        if metric == "itl":
            vals = [g * 1000 for r in recs for g in itls_s(r)]
        else:
            vals = [t * 1000 for t in map(ttft_s, recs) if t is not None]
        if vals:
            xs, ys = _cdf(vals)
            ax.step(xs, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction ≤ x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_attainment(results: Mapping[str, dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, res in results.items():
        pts = res["sweep"]["points"]
        ax.plot([p["rate"] for p in pts], [p["slo_attainment"] for p in pts], "o-", label=name)
        g = res["sweep"]["distserve_goodput"]["value"]
        if g is not None:
            ax.axvline(g, ls=":", alpha=0.6)
    ax.axhline(0.9, color="grey", ls="--", lw=1, label="90 %")
    ax.set_xlabel(f"rate ({' or '.join(sorted({rate_unit(r) for r in results.values()}))})")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def make_plots(results: Mapping[str, dict[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "ITL over time": plot_itl_over_time(results, out / "itl_over_time.png"),
        "ITL CDF": plot_cdf(results, "itl", out / "itl_cdf.png"),
        "TTFT CDF": plot_cdf(results, "ttft", out / "ttft_cdf.png"),
    }
    swept = {n: r for n, r in results.items() if r.get("sweep")}
    if swept:
        plots["SLO attainment vs rate"] = plot_attainment(swept, out / "attainment_vs_rate.png")
    return plots


# ---- HTML --------------------------------------------------------------------------------


def render_html(results: Mapping[str, dict[str, Any]], plots: Mapping[str, Path],
                verdict_line: str | None = None) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(n)}</th>" for n in results)
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                   for row in table_rows(results))
    imgs = "".join(
        f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,"
        f"{base64.b64encode(p.read_bytes()).decode()}'/>" for title, p in plots.items())
    sheets = "".join(
        f"<details><summary>run sheet: {esc(n)}</summary><pre>"
        f"{esc(json.dumps(_clean(r.get('run_sheet', {})), indent=1))}</pre></details>"
        for n, r in results.items())
    verdict = ("<p><b>" + "<br/>".join(esc(x) for x in verdict_line.splitlines()) + "</b></p>"
               if verdict_line else "")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>splitserve bench</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "td,th{padding:2px 10px;text-align:right;border-bottom:1px solid #ddd}"
        "td:first-child{text-align:left}img{max-width:100%}</style></head><body>"
        f"<h1>splitserve bench</h1>{verdict}<table><tr><th>metric</th>{head}</tr>{rows}"
        f"</table>{imgs}<h2>Run sheets</h2>{sheets}</body></html>"
    )


def write_report(results: Mapping[str, dict[str, Any]], out_dir: str | Path,
                 verdict_line: str | None = None, name: str = "report.html") -> Path:
    """Plots as PNG files in `out_dir` and one self-contained HTML report embedding them."""
    plots = make_plots(results, out_dir)
    path = Path(out_dir) / name
    path.write_text(render_html(results, plots, verdict_line))
    return path
