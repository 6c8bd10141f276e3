"""The Grafana dashboards in dashboards/: each file is a dashboard Grafana imports as it is (its
own uid and title, a Prometheus datasource asked for at import, every panel with a datasource
and a query), and every metric any panel's query names exists on a real deployment: the
session's llama P and D behind a router, after a streamed and a non-streamed request, scraped on
the router's and every worker's `/metrics`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.routers import start_router
from tests.support.workers import Worker, auth_headers, model_name

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# PromQL words that look like identifiers but name no metric
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset", "inf", "nan"}
TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`|\[[^\]]*\]'
                   r"|[A-Za-z_:][A-Za-z0-9_:]*|\$\{?\w+\}?|\d[\w.]*|\S")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def dashboards() -> list[tuple[Path, dict[str, Any]]]:
    paths = sorted(DASHBOARDS.glob("*.json"))
    assert paths, f"no dashboards in {DASHBOARDS}"
    return [(p, json.loads(p.read_text())) for p in paths]


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for p in dash.get("panels", []):
        if p.get("type") != "row":
            yield p
        yield from p.get("panels", [])


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions or
    aggregations (followed by `(`, or
    by `by`/`without`), not keywords, not label names inside `{...}` or the lists
    of `by`/`without`/`on`/`ignoring`/`group_*`, not in strings, durations or variables."""
    tokens = TOKEN.findall(expr)
    names: set[str] = set()
    braces = 0
    label_list = False  # inside the parentheses of `by (...)` and the like
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok == "{":
            braces += 1
        elif tok == "}":
            braces -= 1
        elif label_list:
            label_list = tok != ")"
        elif tok.lower() in {"by", "without", "on", "ignoring", "group_left", "group_right"}:
            label_list = nxt == "("
        elif (braces == 0 and re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok)
              and nxt != "(" and nxt.lower() not in ("by", "without")
              and tok.lower() not in KEYWORDS):
            names.add(tok)
    assert braces == 0, f"unbalanced braces in {expr!r}"
    return names


def scraped_names(text: str) -> set[str]:
    """Every name a scrape shows: its samples' names and its families' (`# TYPE` lines), with
    a histogram family's `_bucket`, `_sum` and `_count` series (a family may have no sample yet:
    a counter with labels, such as failures, before the first failure)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names.update(name + s for s in HISTOGRAM_SERIES)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_metric_names_are_parsed_from_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate(vllm:inter_token_latency_'
            'seconds_bucket{instance=~"$decode", job!="x{y}"}[$__rate_interval]))) / on (le) '
            'group_left (url) sum without (pool) (splitserve_router_worker_inflight{role="d"}) '
            '> bool 0 or absent(up) * 2e3')
    assert metric_names(expr) == {"vllm:inter_token_latency_seconds_bucket",
                                  "splitserve_router_worker_inflight", "up"}
    assert metric_names('sum(rate(x_total{a="by (b)"}[5m] offset 1m))') == {"x_total"}


def test_dashboards_are_importable() -> None:
    uids = set()
    for path, dash in dashboards():
        where = path.name
        assert dash.get("title") and dash.get("uid"), where
        assert dash["uid"] not in uids, f"{where}: uid {dash['uid']} is used twice"
        uids.add(dash["uid"])
        assert 36 <= dash["schemaVersion"] <= 41, where
        # import asks for the Prometheus source; panels reach it through the variable
        assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"], where
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", where
        assert variables["datasource"]["query"] == "prometheus", where
        ids = [p["id"] for p in panels(dash)]
        assert ids and len(ids) == len(set(ids)), where
        for p in panels(dash):
            what = f"{where}: panel {p.get('title')!r}"
            assert p.get("title") and p.get("type") in ("timeseries", "stat"), what
            assert p.get("datasource") == DATASOURCE, what
            assert {"h", "w", "x", "y"} <= set(p["gridPos"]), what
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, what
            targets = p.get("targets") or []
            assert targets, f"{what} has no query"
            assert len({t["refId"] for t in targets}) == len(targets), what
            for t in targets:
                assert t.get("datasource") == DATASOURCE, what
                assert t.get("expr") and metric_names(t["expr"]), what
                # a variable the query uses is defined on the dashboard
                for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                    assert var.startswith("__") or var in variables, (what, var)


@pytest.fixture
def scraped(llama_pair: tuple[Worker, Worker], tmp_path: Path) -> dict[str, set[str]]:
    """Each endpoint's scraped names, after requests through a router over the pair."""
    p, d = llama_pair
    router = start_router(tmp_path, "--prefill", p.url, "--decode", d.url)
    try:
        model = model_name(p)
        body = {"model": model, "prompt": "The dashboards " * 40, "max_tokens": 8,
                "temperature": 0}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        chat = {"model": model, "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=chat,
                          timeout=120) as s:
            assert s.status_code == 200
            assert any(line.startswith("data: [DONE]") for line in s.iter_lines())
        router.wait_idle()
        out = {"router": scraped_names(httpx.get(f"{router.url}/metrics", timeout=10).text)}
        for w in (p, d):
            r = httpx.get(f"{w.url}/metrics", headers=auth_headers(), timeout=10)
            assert r.status_code == 200, r.text
            out[w.url] = scraped_names(r.text)
        return out
    finally:
        router.stop()


def test_every_dashboard_metric_exists_on_a_deployment(scraped: dict[str, set[str]]) -> None:
    everywhere = set().union(*scraped.values())
    # the requests reached both legs: the histograms the dashboards read have samples
    assert {"splitserve_router_ttft_seconds_bucket", "splitserve_router_kv_bytes_bucket",
            "vllm:inter_token_latency_seconds_bucket"} <= everywhere
    missing = {}
    used = set()
    for path, dash in dashboards():
        for p in panels(dash):
            for t in p["targets"]:
                names = metric_names(t["expr"])
                used |= names
                gone = sorted(names - everywhere)
                if gone:
                    missing[f"{path.name}: {p['title']}"] = gone
    assert not missing, f"metrics no scrape returned: {missing}"
    # the dashboards read all three kinds of endpoint
    assert used & scraped["router"] and all(used & names for names in scraped.values())
