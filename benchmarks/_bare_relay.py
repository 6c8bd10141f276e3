"""The floor of a router on splitserve's stack: uvicorn (uvloop, httptools) in front, one aiohttp
session behind, and nothing else. Every POST goes to the one upstream worker unchanged and its
answer comes back byte for byte: no authentication, admission, parsing, routing, metrics,
request ids, retries or disconnect handling. What `router_overhead.py` measures for this target
is what the server and the client library cost by themselves; what splitserve's router costs
above it is its own work.

    python benchmarks/_bare_relay.py --upstream http://127.0.0.1:8100 --port 8200
"""

from __future__ import annotations

import argparse

import aiohttp
import uvicorn
from starlette.types import Receive, Scope, Send


class BareRelay:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http":
            await self.relay(scope, receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                    cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.session is not None
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        url = self.upstream + scope["path"]
        if scope["method"] == "GET":
            r = await self.session.get(url)
        else:
            r = await self.session.post(url, data=body,
                                        headers={"Content-Type": "application/json"})
        try:
            ctype = r.headers.get("Content-Type", "application/json").encode()
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type", ctype)]})
            async for piece in r.content.iter_any():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            r.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(BareRelay(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
