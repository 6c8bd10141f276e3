"""Screenshots of the Grafana dashboards in dashboards/, drawn with matplotlib from a real run.

Grafana is not in Debian's or PyPI's registries, so this renders the same panels itself: it
starts a deployment (what `splitserve serve --prefill 1 --decode 1` starts: the embedded demo
model, 1P+1D on this machine) or scrapes a running one (`--url ROUTER`, with the deployment
token in SPLITSERVE_TOKEN for the workers' `/metrics`), sends a small load through the router,
scrapes the router's and every worker's `/metrics` every second, evaluates each panel's PromQL
on those samples, and draws one PNG per dashboard, its panels where the dashboard places them.

The evaluator knows only what the dashboards' queries use: selectors with label matchers and
a range, `rate`/`increase`, `histogram_quantile`, `sum`/`max`/`min`/`avg` with `by`, and
arithmetic between vectors with the same labels or with numbers. `$__rate_interval` is
`--window` seconds (15 by default); `$prefill` and `$decode` match every worker of that pool.
Each worker's series get the label `instance` (host:port), as a Prometheus scrape adds it.

    python benchmarks/dashboards.py --out docs/operations/img            # starts 1P+1D
    python benchmarks/dashboards.py --url http://127.0.0.1:8000 --out /tmp/shots
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, np.ndarray]


# --------------------------------------------------------------------------- scraping


@dataclass
class Samples:
    """Every scrape's samples: `series[name][labels]` is a value per scrape (NaN: absent)."""

    times: list[float] = field(default_factory=list)
    series: dict[str, dict[Labels, dict[int, float]]] = field(
        default_factory=lambda: defaultdict(dict))

    def add(self, t: float, texts: dict[str, str]) -> None:
        i = len(self.times)
        self.times.append(t)
        for instance, text in texts.items():
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    labels = frozenset({**s.labels, "instance": instance}.items())
                    self.series[s.name].setdefault(labels, {})[i] = float(s.value)

    def dump(self, path: Path, variables: dict[str, str]) -> None:
        series = {name: [[sorted(labels), points] for labels, points in by.items()]
                  for name, by in self.series.items()}
        path.write_text(json.dumps({"times": self.times, "variables": variables,
                                    "series": series}))

    @classmethod
    def load(cls, path: Path) -> tuple[Samples, dict[str, str]]:
        data = json.loads(path.read_text())
        out = cls(times=data["times"])
        for name, rows in data["series"].items():
            for labels, points in rows:
                out.series[name][frozenset(tuple(x) for x in labels)] = {
                    int(i): v for i, v in points.items()}
        return out, data["variables"]

    def vector(self, name: str) -> Vector:
        n = len(self.times)
        out = {}
        for labels, points in self.series.get(name, {}).items():
            arr = np.full(n, np.nan)
            for i, v in points.items():
                arr[i] = v
            out[labels] = arr
        return out


def instance_of(url: str) -> str:
    return re.sub(r"^https?://", "", url).split("/")[0]


def scrape(client: httpx.Client, router: str, workers: list[str], token: str) -> dict[str, str]:
    texts = {instance_of(router): client.get(f"{router}/metrics").text}
    for url in workers:
        r = client.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
        if r.status_code == 200:
            texts[instance_of(url)] = r.text
    return texts


# --------------------------------------------------------------------------- the load


def load(router: str, stop: threading.Event, seed: int) -> None:
    """Requests until `stop`: non-streamed completions and streamed chats, some of them sharing
    a long prefix (so the cache-aware routing and prefill on D have something to find)."""
    rng = np.random.default_rng(seed)
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{router}/v1/models").json()["data"][0]["id"]
        n = 0
        while not stop.is_set():
            n += 1
            shared = "The operator reads the dashboards of the deployment. " * 12
            tail = " ".join(f"w{int(x)}" for x in rng.integers(0, 5000, int(rng.integers(8, 80))))
            prompt = (shared if n % 2 else "") + tail
            tokens = int(rng.integers(8, 48))
            try:
                if n % 3:
                    client.post(f"{router}/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": tokens})
                else:
                    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": tokens, "stream": True}
                    with client.stream("POST", f"{router}/v1/chat/completions", json=body) as s:
                        for _ in s.iter_lines():
                            pass
            except httpx.HTTPError:
                time.sleep(0.5)


# --------------------------------------------------------------------------- PromQL, a subset

TOKEN = re.compile(r'\s*(?:(?P<str>"(?:\\.|[^"\\])*")|(?P<range>\[[^\]]*\])|(?P<num>\d[\w.]*)'
                   r"|(?P<op>=~|!~|!=|[-+*/(),{}=])|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*))")
AGGREGATIONS = {"sum": np.nansum, "max": np.nanmax, "min": np.nanmin, "avg": np.nanmean}


def duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text))


@dataclass
class RangeSel:
    vector: Vector
    window_s: float


class Query:
    """Evaluate one expression over every scrape time of `samples`."""

    def __init__(self, expr: str, samples: Samples) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        expr = expr.strip()
        while pos < len(expr):
            m = TOKEN.match(expr, pos)
            if not m or m.end() == pos:
                raise ValueError(f"cannot read {expr[pos:]!r}")
            kind = m.lastgroup or ""
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0
        self.samples = samples
        self.times = np.array(samples.times)

    def peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def take(self, want: str | None = None) -> str:
        tok = self.tokens[self.i][1]
        if want is not None and tok != want:
            raise ValueError(f"expected {want!r}, got {tok!r}")
        self.i += 1
        return tok

    def run(self) -> Vector | float:
        out = self.expr()
        if self.i != len(self.tokens):
            raise ValueError(f"unread: {self.tokens[self.i:]}")
        return out

    def expr(self) -> Any:
        left = self.term()
        while self.peek() in ("+", "-"):
            left = binary(self.take(), left, self.term())
        return left

    def term(self) -> Any:
        left = self.primary()
        while self.peek() in ("*", "/"):
            left = binary(self.take(), left, self.primary())
        return left

    def labels_list(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return names

    def primary(self) -> Any:
        kind, tok = self.tokens[self.i]
        if kind == "num":
            self.i += 1
            return float(tok)
        if tok == "(":
            self.take()
            inner = self.expr()
            self.take(")")
            return inner
        self.i += 1
        if tok in AGGREGATIONS:
            by = self.labels_list() if self.peek() == "by" and self.take() else None
            self.take("(")
            inner = self.expr()
            self.take(")")
            if by is None and self.peek() == "by":
                self.take()
                by = self.labels_list()
            return aggregate(tok, inner, by or [])
        if tok in ("rate", "increase"):
            self.take("(")
            sel = self.primary()
            self.take(")")
            return rate(sel, self.times, tok == "increase")
        if tok == "histogram_quantile":
            self.take("(")
            q = self.expr()
            self.take(",")
            inner = self.expr()
            self.take(")")
            return quantile(float(q), inner)
        return self.selector(tok)

    def selector(self, name: str) -> Vector | RangeSel:
        matchers = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), json.loads(self.take())
                matchers.append((label, op, value))
                if self.peek() == ",":
                    self.take()
            self.take("}")
        vec = {k: v for k, v in self.samples.vector(name).items()
               if all(match(dict(k).get(label, ""), op, value) for label, op, value in matchers)}
        if self.i < len(self.tokens) and self.tokens[self.i][0] == "range":
            return RangeSel(vec, duration_s(self.take()))
        return vec


def match(actual: str, op: str, value: str) -> bool:
    if op == "=":
        return actual == value
    if op == "!=":
        return actual != value
    hit = re.fullmatch(value, actual) is not None
    return hit if op == "=~" else not hit


def rate(sel: RangeSel, times: np.ndarray, increase: bool) -> Vector:
    """Per-second increase over the window, from the first and last sample in it (counter
    resets taken as restarts from zero)."""
    out = {}
    for labels, values in sel.vector.items():
        res = np.full(len(times), np.nan)
        for i, t in enumerate(times):
            idx = [j for j in range(i + 1) if times[j] > t - sel.window_s
                   and not math.isnan(values[j])]
            if len(idx) < 2:
                continue
            v = values[idx]
            delta = float(np.sum(np.where(np.diff(v) < 0, v[1:], np.diff(v))))
            span = times[idx[-1]] - times[idx[0]]
            res[i] = delta * sel.window_s / span if increase else delta / span
        out[frozenset((k, v) for k, v in labels if k != "__name__")] = res
    return out


def aggregate(op: str, vec: Vector, by: list[str]) -> Vector:
    groups: dict[Labels, list[np.ndarray]] = defaultdict(list)
    for labels, values in vec.items():
        groups[frozenset((k, v) for k, v in labels if k in by)].append(values)
    out = {}
    for key, arrays in groups.items():
        stacked = np.vstack(arrays)
        with np.errstate(all="ignore"):
            reduced = AGGREGATIONS[op](stacked, axis=0)
        reduced[np.all(np.isnan(stacked), axis=0)] = np.nan
        out[key] = reduced
    return out


def quantile(q: float, vec: Vector) -> Vector:
    """Prometheus's histogram_quantile: linear within the bucket the rank falls in."""
    groups: dict[Labels, list[tuple[float, np.ndarray]]] = defaultdict(list)
    for labels, values in vec.items():
        d = dict(labels)
        le = float(d.pop("le"))
        groups[frozenset(d.items())].append((le, values))
    out = {}
    for key, buckets in groups.items():
        buckets.sort(key=lambda b: b[0])
        les = [b[0] for b in buckets]
        counts = np.vstack([b[1] for b in buckets])
        res = np.full(counts.shape[1], np.nan)
        for t in range(counts.shape[1]):
            c = counts[:, t]
            if np.isnan(c).any() or c[-1] <= 0:
                continue
            rank = q * c[-1]
            b = int(np.searchsorted(c, rank))
            if b >= len(les) - 1:  # the +Inf bucket: the highest finite bound
                res[t] = les[-2]
                continue
            lo_le, lo_c = (0.0, 0.0) if b == 0 else (les[b - 1], c[b - 1])
            width = c[b] - lo_c
            res[t] = lo_le + (les[b] - lo_le) * ((rank - lo_c) / width if width else 1.0)
        out[key] = res
    return out


def binary(op: str, left: Any, right: Any) -> Any:
    def apply(a: Any, b: Any) -> Any:
        with np.errstate(all="ignore"):
            return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]

    if isinstance(left, float) and isinstance(right, float):
        return apply(left, right)
    if isinstance(right, float):
        return {k: apply(v, right) for k, v in left.items()}
    if isinstance(left, float):
        return {k: apply(left, v) for k, v in right.items()}
    out = {k: apply(v, right[k]) for k, v in left.items() if k in right}
    for v in out.values():
        v[~np.isfinite(v)] = np.nan
    return out


def evaluate(expr: str, samples: Samples, variables: dict[str, str], window_s: float) -> Vector:
    expr = expr.replace("$__rate_interval", f"{window_s:g}s")
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    out = Query(expr, samples).run()
    return out if isinstance(out, dict) else {frozenset(): np.full(len(samples.times), out)}


# --------------------------------------------------------------------------- drawing

BG, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff",
          "#fade2a", "#56a64b", "#e0b400"]


def legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    if fmt in ("", "__auto"):
        return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt).strip()


def format_value(v: float, unit: str) -> str:
    if math.isnan(v):
        return "-"
    if unit == "percentunit":
        return f"{v * 100:.1f}%" if abs(v) < 0.1 else f"{v * 100:.0f}%"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= scale:
                return f"{v / scale:.1f} {name}{suffix}"
        return f"{v:.0f} B{suffix}"
    if unit == "reqps":
        return f"{v:.2f} req/s"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f} M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.1f} k"
    return f"{v:.3g}"


def draw(dash: dict[str, Any], samples: Samples, variables: dict[str, str], window_s: float,
         out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    panels = [p for p in dash["panels"] if p.get("type") != "row"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.36  # inches per grid unit of height
    width_in, height_in = 16.0, rows * unit_h + 0.6
    fig = plt.figure(figsize=(width_in, height_in), facecolor=BG)
    fig.text(0.01, 1 - 0.35 / height_in, dash["title"], color=TEXT, fontsize=13,
             va="center", weight="bold")
    fig.text(0.99, 1 - 0.35 / height_in,
             f"rendered from {len(samples.times)} scrapes, 1 s apart; rate window "
             f"{window_s:g} s", color="#8e8e8e", fontsize=8, va="center", ha="right")
    t0 = samples.times[0]
    x = np.array(samples.times) - t0
    top = 1 - 0.6 / height_in
    for p in panels:
        g = p["gridPos"]
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        left, w = g["x"] / 24, g["w"] / 24
        h = g["h"] * unit_h / height_in
        bottom = top - (g["y"] * unit_h / height_in) - h
        frame = fig.add_axes((left + 0.004, bottom + 0.004, w - 0.008, h - 0.008))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        frame.text(0.02, 0.93, p["title"], color=TEXT, fontsize=9, weight="bold",
                   transform=frame.transAxes, va="center")
        lines = []
        for t in p["targets"]:
            try:
                vec = evaluate(t["expr"], samples, variables, window_s)
            except (ValueError, KeyError, IndexError) as exc:
                raise SystemExit(f"{dash['uid']}: {p['title']}: {t['expr']}: {exc}") from exc
            for labels, values in sorted(vec.items(), key=lambda kv: sorted(kv[0])):
                lines.append((legend(t.get("legendFormat", ""), labels), values))
        if p["type"] == "stat":
            text = "   ".join(f"{name}: {format_value(float(v[-1]), unit)}"
                              for name, v in lines) or "No data"
            frame.text(0.5, 0.42, text, color=COLORS[0], fontsize=16, weight="bold",
                       ha="center", va="center", transform=frame.transAxes)
            continue
        ax = fig.add_axes((left + 0.035, bottom + h * 0.27, w - 0.045, h * 0.55))
        ax.set_facecolor(PANEL)
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.grid(color=GRID, linewidth=0.5)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: format_value(v, u)))
        ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}s"))
        drawn = 0
        for k, (name, values) in enumerate(lines):
            if np.all(np.isnan(values)):
                continue
            ax.plot(x, values, color=COLORS[k % len(COLORS)], linewidth=1.2, label=name)
            drawn += 1
        ax.set_xlim(0, x[-1] if len(x) > 1 else 1)
        if not drawn:
            ax.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", va="center",
                    transform=ax.transAxes, fontsize=10)
            ax.set_yticks([])
            continue
        ax.set_ylim(bottom=min(0.0, float(np.nanmin([np.nanmin(v) for _, v in lines
                                                     if not np.all(np.isnan(v))]))))
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=6.5,
                  frameon=False, labelcolor=TEXT, handlelength=1.2)
    fig.savefig(out, dpi=72, facecolor=BG)
    plt.close(fig)


# --------------------------------------------------------------------------- the run


def collect(router: str, token: str, seconds: float, clients: int) -> tuple[Samples,
                                                                           dict[str, str]]:
    with httpx.Client(timeout=10) as client:
        workers = client.get(f"{router}/workers").json()["workers"]
        urls = [w["url"] for w in workers]
        pools: dict[str, list[str]] = defaultdict(list)
        for w in workers:
            # as Grafana writes a multi-value variable into a PromQL string: regex-escaped, the
            # escapes doubled
            pools[w["role"]].append(re.escape(instance_of(w["url"])).replace("\\", "\\\\"))
        variables = {role: "|".join(v) for role, v in pools.items()}
        for role in ("prefill", "decode"):
            variables.setdefault(role, "^$")
        samples = Samples()
        stop = threading.Event()
        threads = [threading.Thread(target=load, args=(router, stop, k), daemon=True)
                   for k in range(clients)]
        start = time.monotonic()
        samples.add(time.time(), scrape(client, router, urls, token))
        for th in threads:
            th.start()
        try:
            while time.monotonic() - start < seconds:
                time.sleep(max(0.0, 1.0 - (time.monotonic() - start) % 1.0))
                samples.add(time.time(), scrape(client, router, urls, token))
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=120)
    return samples, variables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running deployment's router (default: start 1P+1D here); "
                    "the workers' /metrics need SPLITSERVE_TOKEN")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "operations" / "img")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to sample (60)")
    ap.add_argument("--clients", type=int, default=2, help="concurrent request loops (2)")
    ap.add_argument("--window", type=float, default=15.0,
                    help="seconds $__rate_interval stands for (15)")
    ap.add_argument("--dashboards", type=Path, default=DASHBOARDS)
    ap.add_argument("--samples", type=Path, default=None,
                    help="keep the scraped samples in this JSON file (default: /tmp/"
                    "splitserve-dashboards-PID.json)")
    ap.add_argument("--replay", type=Path, default=None,
                    help="draw from samples a run kept, starting and scraping nothing")
    args = ap.parse_args(argv)
    dashboards = sorted(args.dashboards.glob("*.json"))
    args.out.mkdir(parents=True, exist_ok=True)
    deployment = None
    if args.replay:
        samples, variables = Samples.load(args.replay)
        return render(dashboards, samples, variables, args.window, args.out)
    if args.url:
        router, token = args.url.rstrip("/"), os.environ.get("SPLITSERVE_TOKEN", "")
    else:
        from splitserve.launch.config import from_mapping
        from splitserve.launch.local import LocalDeployment
        from splitserve.worker.launch import free_port

        cfg = from_mapping({}, {"prefill": 1, "decode": 1, "model": "embedded",
                                "port": free_port()})
        deployment = LocalDeployment(cfg)
        router, token = deployment.start(), deployment.token
    try:
        samples, variables = collect(router, token, args.seconds, args.clients)
    finally:
        if deployment is not None:
            deployment.stop()
    keep = args.samples or Path("/tmp") / f"splitserve-dashboards-{os.getpid()}.json"
    samples.dump(keep, variables)
    print(f"samples: {keep} (draw again with --replay {keep})")
    return render(dashboards, samples, variables, args.window, args.out)


def render(dashboards: list[Path], samples: Samples, variables: dict[str, str], window_s: float,
           out: Path) -> int:
    for path in dashboards:
        dash = json.loads(path.read_text())
        png = out / f"{path.stem}.png"
        draw(dash, samples, variables, window_s, png)
        print(f"{png} ({png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
