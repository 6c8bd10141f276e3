"""Headless Chromium (Debian's `chromium` package, installed by `make install`) driven over the
DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages ended by NUL on fds 3
and 4), with nothing but the standard library: no port, no downloaded browser.

`with browser() as b: page = b.open(url)` loads a page (its workers included) and returns what
a person opening it would meet: every console error, uncaught exception, failed load and HTTP
error (`Page.errors`), every `<img>` with whether it decoded (`Page.images()`), and
`Page.evaluate` / `Page.screenshot` for more. `serve_directory` serves a built site over HTTP.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = ("headless Chromium is missing: run `make install` (it installs Debian's "
                "`chromium` package with apt-get)")

# JS: every <img> and whether it loaded (complete with a decoded width), in document order.
IMAGES_JS = """[...document.images].map(i => ({
    src: i.currentSrc.slice(0, 80), alt: i.alt, complete: i.complete,
    width: i.naturalWidth, height: i.naturalHeight}))"""


def chromium_path() -> str:
    """The system Chromium, or an AssertionError that names `make install`."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, INSTALL_HINT
    return path


@dataclass
class Page:
    """One loaded page: its problems as the browser reported them, and a live session."""

    browser: Browser
    session: str
    url: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)  # request id -> URL

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression in the page (awaited when it is a promise)."""
        r = self.browser.call("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True},
            self.session)
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")

    def images(self) -> list[dict[str, Any]]:
        return list(self.evaluate(IMAGES_JS))

    def screenshot(self, height: int | None = None) -> bytes:
        """A PNG of the first screen, or of the page's top `height` pixels (the whole page
        when it is shorter), at the viewport's width."""
        params: dict[str, Any] = {"format": "png"}
        if height is not None:
            full = self.evaluate("document.documentElement.scrollHeight")
            params |= {"captureBeyondViewport": True,
                       "clip": {"x": 0, "y": 0, "width": self.browser.width,
                                "height": min(height, full), "scale": 1}}
        data = self.browser.call("Page.captureScreenshot", params, self.session)["data"]
        return base64.b64decode(data)


class Browser:
    """A headless Chromium process and its DevTools pipe (synchronous: one call at a time;
    events arriving meanwhile go to the pages they belong to)."""

    def __init__(self, profile: str, width: int = 1200, height: int = 900) -> None:
        self.width, self.height = width, height
        to_browser, self._write = self._pipe()  # our writes: the browser's fd 3
        self._read, from_browser = self._pipe()  # the browser's fd 4: our reads
        argv = [chromium_path(), "--headless", "--no-sandbox", "--disable-gpu",
                "--remote-debugging-pipe", f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "--hide-scrollbars",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--mute-audio", "about:blank"]
        # fds 3 and 4 in the browser; ours are >= 10, so the redirections cannot clobber them
        # (bash: dash takes single-digit fds only).
        shell = f'exec "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-'
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(["bash", "-c", shell, "bash", *argv],
                                     pass_fds=(to_browser, from_browser), stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        os.close(to_browser)
        os.close(from_browser)
        self._buf = b""
        self._next_id = 0
        self._pages: dict[str, Page] = {}  # by session: a tab's own and its workers'
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    @staticmethod
    def _pipe() -> tuple[int, int]:
        r, w = os.pipe()
        out = (fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(r)
        os.close(w)
        return out

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def _message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0, f"Chromium did not answer in time; its output:\n{self.output()}"
            ready, _, _ = select.select([self._read], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._read, 1 << 20)
                assert chunk, f"Chromium closed its DevTools pipe; its output:\n{self.output()}"
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise AssertionError(f"Chromium exited ({self.proc.returncode}); its output:\n"
                                     f"{self.output()}")
        raw, self._buf = self._buf.split(b"\0", 1)
        return dict(json.loads(raw))

    def _event(self, msg: dict[str, Any]) -> None:
        self.events.append(msg)
        session = msg.get("sessionId", "")
        page = self._pages.get(session)
        if page is None:
            return
        if msg["method"] == "Target.attachedToTarget":  # a worker of the page: watch it too
            child = msg["params"]["sessionId"]
            self._pages[child] = page
            self._watch(child)
            self.call("Runtime.runIfWaitingForDebugger", {}, child)
        note(page, msg["method"], msg.get("params", {}))

    def _watch(self, session: str) -> None:
        for domain in ("Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", {}, session)
        self.call("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": True,
                                           "flatten": True}, session)

    def _take(self, deadline: float) -> None:
        """Read one message: a reply is kept for its caller, an event is handled now."""
        msg = self._message(deadline)
        if "id" in msg:
            self._replies[msg["id"]] = msg
        elif "method" in msg:
            self._event(msg)

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        mid = self._next_id
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while mid not in self._replies:
            self._take(deadline)  # events may call() in turn: replies are matched by id
        reply = self._replies.pop(mid)
        assert "error" not in reply, (method, reply["error"])
        return dict(reply.get("result", {}))

    def pump(self, seconds: float) -> None:
        """Take the events that arrive within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._take(deadline)
            except AssertionError:
                if time.monotonic() >= deadline and self.proc.poll() is None:
                    return
                raise

    def open(self, url: str, settle_s: float = 1.0, timeout_s: float = 30.0) -> Page:
        """A new tab at `url`, after its load event and `settle_s` without a network request
        in flight (so late scripts, fonts and images are counted)."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}
                            )["sessionId"]
        page = Page(self, session, url)
        self._pages[session] = page
        self.call("Page.enable", {}, session)
        self._watch(session)
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 1,
            "mobile": False}, session)
        first = len(self.events)
        nav = self.call("Page.navigate", {"url": url}, session)
        assert not nav.get("errorText"), (url, nav)
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == "Page.loadEventFired" and e.get("sessionId") == session
                      for e in self.events[first:]):
            assert time.monotonic() < deadline, f"{url}: no load event in {timeout_s} s"
            self.pump(0.1)
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < settle_s:
            assert time.monotonic() < deadline, f"{url}: requests still in flight: {page}"
            before = len(self.events)
            self.pump(0.1)
            busy = any(e["method"].startswith("Network.") for e in self.events[before:])
            if busy or inflight(self.events[first:], self.sessions(page)):
                quiet_since = time.monotonic()
        return page

    def sessions(self, page: Page) -> set[str]:
        return {s for s, p in self._pages.items() if p is page}

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=5.0)
        except (AssertionError, OSError):  # already gone
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        os.close(self._read)
        os.close(self._write)
        self.log.close()


def inflight(events: list[dict[str, Any]], sessions: set[str]) -> set[str]:
    """Request ids sent (in any of `sessions`) and neither finished nor failed yet."""
    open_: set[str] = set()
    for e in events:
        if e.get("sessionId") not in sessions:
            continue
        rid = e.get("params", {}).get("requestId")
        if e["method"] == "Network.requestWillBeSent":
            open_.add(rid)
        elif e["method"] in ("Network.loadingFinished", "Network.loadingFailed"):
            open_.discard(rid)
    return open_


def _where(d: dict[str, Any]) -> str:
    url = d.get("url") or ""
    line = d.get("lineNumber")
    return f" ({url}{'' if line is None else f':{line + 1}'})" if url else ""


def note(page: Page, method: str, p: dict[str, Any]) -> None:
    """Sort one DevTools event into the page's errors and warnings."""
    if method == "Runtime.consoleAPICalled":
        text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
        frame = (p.get("stackTrace") or {}).get("callFrames") or [{}]
        line = f"console.{p['type']}: {text}{_where(frame[0])}"
        if p["type"] in ("error", "assert"):
            page.errors.append(line)
        elif p["type"] == "warning":
            page.warnings.append(line)
    elif method == "Runtime.exceptionThrown":
        d = p["exceptionDetails"]
        text = (d.get("exception") or {}).get("description") or d.get("text", "")
        page.errors.append(f"uncaught: {text}{_where(d)}")
    elif method == "Log.entryAdded":
        e = p["entry"]
        line = f"{e['source']} {e['level']}: {e['text']}{_where(e)}"
        if e["level"] == "error":
            page.errors.append(line)
        elif e["level"] == "warning":
            page.warnings.append(line)
    elif method == "Network.requestWillBeSent":
        page.requests[p["requestId"]] = p["request"]["url"][:200]
    elif method == "Network.loadingFailed" and not p.get("canceled"):
        url = page.requests.get(p["requestId"], "?")
        page.errors.append(f"load failed: {p.get('type')} {url}: {p.get('errorText')}")
    elif method == "Network.responseReceived" and p["response"].get("status", 200) >= 400:
        page.errors.append(f"HTTP {p['response']['status']}: {p['response']['url']}")


@contextmanager
def browser(width: int = 1200, height: int = 900) -> Iterator[Browser]:
    """A headless Chromium for the block, with a throwaway profile."""
    with tempfile.TemporaryDirectory(prefix="splitserve-chromium-") as profile:
        b = Browser(profile, width, height)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def serve_directory(root: str | os.PathLike[str]) -> Iterator[str]:
    """`root` over HTTP on loopback from a thread of this process (as `mkdocs serve` or any
    static host would serve a built site); yields its base URL."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(Quiet, directory=os.fspath(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
