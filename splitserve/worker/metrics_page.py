"""A worker's `/metrics` page, rendered off the event loop.

Contract: the page is prometheus_client's exposition of the registry (the format the scraper's
`Accept` asks for, gzip when it accepts gzip, `name[]` to restrict it), and every collector runs
on a worker thread, never on the API server's event loop: a collector that waits on a rank's
control channel (`rank_listeners.ConnectorCollector`, up to its timeout per rank) delays the
scrape, never the requests the server is streaming.
"""

from __future__ import annotations

import asyncio
import gzip
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send


def render(registry: CollectorRegistry, accept: str, accept_encoding: str,
           names: list[str] | None = None) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The page's body and headers (blocking: the collectors run here)."""
    encoder, content_type = choose_encoder(accept)
    body = encoder(registry.restricted_registry(names) if names else registry)
    headers = [(b"content-type", content_type.encode())]
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers.append((b"content-encoding", b"gzip"))
    return body, headers


def metrics_app(registry: CollectorRegistry) -> ASGIApp:
    """An ASGI app serving `registry` (see the module's contract)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        headers = Headers(scope=scope)
        names = parse_qs(scope.get("query_string", b"").decode()).get("name[]")
        body, out = await asyncio.to_thread(render, registry, headers.get("accept", ""),
                                            headers.get("accept-encoding", ""), names)
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": body})

    return app
