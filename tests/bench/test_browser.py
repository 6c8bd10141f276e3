"""`splitserve bench report`'s HTML and the documentation site's index, opened in a real browser:
headless Chromium from Debian's `chromium` package (`make install` installs it; never a
downloaded browser), driven over the DevTools protocol (tests/support/browser.py).

Each page must load with no console error, no uncaught exception and no failed request, every
image must decode, and the report's verdict must be on its first screen, rendered and uncovered.
The report is rebuilt by `bench report` from the result JSON of a real `bench compare` run: the
session's llama P worker answering plain requests (colocated) against 1P1D through a router.
`SPLITSERVE_REPORT_SCREENSHOT=PATH` also writes the report's top 1,400 pixels there (how
docs/images/bench-report.png is made).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.bench.verdict import verdict
from splitserve.cli import main
from tests.support.browser import Page, browser, chromium_path, serve_directory
from tests.support.routers import start_router
from tests.support.workers import LOG_DIR, TOKEN, Worker

ROOT = Path(__file__).resolve().parents[2]
STREAM = ["--num-prompts", "10", "--request-rate", "20", "--input-dist", "uniform",
          "--input-min", "20", "--input-max", "300", "--output-len", "12", "--seed", "28",
          "--warmup", "1"]
PLOTS = ["ITL over time", "ITL CDF", "TTFT CDF"]

# JS, given `text`: the innermost element whose text holds it, and whether a person sees it on
# the first screen: laid out with a size, not hidden, not transparent, inside the viewport,
# on top at its centre, and in the page's rendered text (innerText skips what is not rendered).
VISIBLE_JS = """(text => {
  const all = [...document.body.querySelectorAll('*')].filter(e => e.textContent.includes(text));
  const el = all.find(e => ![...e.children].some(c => c.textContent.includes(text)));
  if (!el) return {found: false};
  const r = el.getBoundingClientRect(), s = getComputedStyle(el);
  let opaque = true;
  for (let e = el; e; e = e.parentElement) opaque &&= getComputedStyle(e).opacity !== '0';
  const top = document.elementFromPoint(r.left + r.width / 2, r.top + Math.min(r.height, 20) / 2);
  return {found: true, tag: el.tagName, width: r.width, height: r.height, top: r.top,
          on_first_screen: r.top >= 0 && r.top < innerHeight && r.bottom > 0,
          shown: s.display !== 'none' && s.visibility === 'visible' && opaque,
          on_top: !!top && (el.contains(top) || top.contains(el)),
          rendered: document.body.innerText.includes(text)};
})"""


def problems(page: Page) -> list[str]:
    """What is wrong with a loaded page: its errors, then each image that did not load."""
    out = list(page.errors)
    for i, img in enumerate(page.images()):
        if not (img["complete"] and img["width"] > 0):
            out.append(f"image {i} ({img['alt'] or img['src']}) did not load: {img}")
    return out


def seen(page: Page, text: str) -> dict:
    return dict(page.evaluate(f"{VISIBLE_JS}({json.dumps(text)})"))


def assert_visible(page: Page, text: str) -> None:
    where = seen(page, text)
    assert where["found"], f"{text!r} is not in the page"
    assert where["width"] > 0 and where["height"] > 0, where
    assert where["shown"] and where["rendered"], f"{text!r} is hidden: {where}"
    assert where["on_first_screen"], f"{text!r} is below the first screen: {where}"
    assert where["on_top"], f"{text!r} is covered by another element: {where}"


@pytest.fixture(scope="module")
def report(llama_pair: tuple[Worker, Worker], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Path, str]]:
    """A real run: `bench compare` (the identical stream) of the P worker alone (plain requests,
    colocated) against 1P1D through a router, then `bench report` from its result JSON.
    Yields report.html and the verdict line the report must show."""
    p, d = llama_pair
    tmp = tmp_path_factory.mktemp("browser-report")
    router = start_router(tmp, "--prefill", p.url, "--decode", d.url)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPLITSERVE_API_KEY", TOKEN)  # the bench's key for the workers
            mp.setenv("SPLITSERVE_TOKEN", TOKEN)  # and to read their /metrics
            assert main(["bench", "compare", "--url", f"colocated={p.url}", "--url",
                         f"1p1d={router.url}", "--out", str(tmp / "run"), *STREAM]) == 0
    finally:
        router.stop()
    runs = [tmp / "run" / "colocated.json", tmp / "run" / "1p1d.json"]
    assert main(["bench", "report", *map(str, runs), "--out", str(tmp / "report")]) == 0
    results = {r["system"]: r for r in (json.loads(f.read_text()) for f in runs)}
    line = verdict(results)
    assert line.startswith("1p1d vs colocated: p99 ITL"), line
    yield tmp / "report" / "report.html", line


def test_the_report_in_a_browser(report: tuple[Path, str]) -> None:
    path, line = report
    with browser() as b:
        page = b.open(path.as_uri())
        assert problems(page) == [], problems(page)
        images = page.images()
        assert [i["alt"] for i in images] == PLOTS, images
        assert all(i["width"] >= 600 and i["height"] >= 300 for i in images), images
        assert_visible(page, line)
        assert page.evaluate("document.title") == "splitserve bench"
        shot = page.screenshot(height=1400)  # the verdict, the table and the first plot
    assert shot.startswith(b"\x89PNG")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "bench-report.png").write_bytes(shot)
    if os.environ.get("SPLITSERVE_REPORT_SCREENSHOT"):
        Path(os.environ["SPLITSERVE_REPORT_SCREENSHOT"]).write_bytes(shot)


# Material's default theme font comes from Google Fonts: a request off the machine that fails
# offline (an error in the console) and that a docs site should not make at all.
FONTS = "https://fonts.googleapis.com/"


def test_the_docs_site_index_in_a_browser(tmp_path: Path) -> None:
    """The site as `make docs` builds it (the same strict build, into a temporary directory so
    that it is this checkout's docs), served over HTTP as `mkdocs serve` or a host serves it."""
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=120)
    assert build.returncode == 0, build.stderr[-3000:]
    with browser() as b, serve_directory(site) as base:
        page = b.open(f"{base}/index.html")
        found = problems(page)
        assert page.evaluate("document.title") == "splitserve"
        assert_visible(page, "splitserve")
    assert found == [], found


def test_the_check_fails_on_a_broken_page(tmp_path: Path) -> None:
    """The checks above can fail: a console error, an exception, a missing and a corrupt image,
    a hidden verdict, a covered one and one below the first screen are each reported."""
    (tmp_path / "good.svg").write_text(
        "<svg xmlns='http://www.w3.org/2000/svg' width='40' height='20'/>")
    (tmp_path / "broken.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>t</title></head><body>"
        "<p style='visibility:hidden'>HIDDEN VERDICT</p>"
        "<p id=under>COVERED VERDICT</p><div style='position:absolute;top:0;left:0;"
        "width:100%;height:200px;background:#fff'></div>"
        "<img alt=ok src='good.svg'><img alt=missing src='no-such.png'>"
        "<img alt=corrupt src='data:image/png;base64,iVBORw0KGgoAAAAN'>"
        "<div style='height:3000px'></div><p>LOW VERDICT</p>"
        "<script>console.error('boom'); null.x;</script></body></html>")
    with browser() as b:
        page = b.open((tmp_path / "broken.html").as_uri())
        found = problems(page)
        assert any("console.error: boom" in f for f in found), found
        assert any(f.startswith("uncaught: TypeError") for f in found), found
        assert any("no-such.png" in f and "ERR_FILE_NOT_FOUND" in f for f in found), found
        assert any(f.startswith("image 1 (missing)") for f in found), found
        assert any(f.startswith("image 2 (corrupt)") for f in found), found
        assert not any(f.startswith("image 0") for f in found), found
        for text, why in (("HIDDEN VERDICT", "hidden"), ("COVERED VERDICT", "covered"),
                          ("LOW VERDICT", "below the first screen"), ("NO VERDICT", "not in")):
            with pytest.raises(AssertionError, match=why):
                assert_visible(page, text)


def test_a_missing_chromium_names_make_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(AssertionError, match="make install"):
        chromium_path()
