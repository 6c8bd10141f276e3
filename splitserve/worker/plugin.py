"""vLLM endpoint plugin: splitserve's routes and metrics on a worker's OpenAI server.

Loaded by vLLM in the API-server process (entry point `vllm.endpoint_plugins`). It guards the
server when a deployment token is set, and adds the connector's routes and metrics only when
the server runs splitserve's connector (a worker running vLLM's NixlConnector gets
`/splitserve/info` alone: its connector, role and NIXL side channel; the cache report below is
on every worker). The connector's state lives in the worker process,
so every route and the metrics collector ask the connector's listeners (one a tensor-parallel
rank: `worker.rank_listeners`) over their authenticated control channel — which works while the
engine is idle.

Authentication: whenever the worker holds a deployment token (its environment), every HTTP path —
the OpenAI API, `/health`, `/metrics`, and the routes below — requires
`Authorization: Bearer <deployment token>`. A worker is an internal surface; the router is the
public one.

Routes, each answering the `to_json()` of its `common.wire` type: `/splitserve/load`
(`WorkerLoad`, on every worker: the three vLLM gauges the router routes by, read from the
registry without rendering `/metrics`, which costs the API server ~4 ms of CPU on the engine's
core), `/splitserve/info` (`WorkerInfo`), `/splitserve/state` (`ConnectorState`),
`/splitserve/transfers/{transfer_id}` (GET: the `TransferRecord`; DELETE: free staged KV that no
decode request will claim). The connector's answers are parsed into those types here, so a
malformed one is a 502, never passed on. Metrics: `splitserve_kv_*` families in the worker's
`/metrics`.

Every worker that `worker_command` started to report its cache (P, D and plain; either
connector) also relays its engine's KV cache events (`worker.kvrelay`): `GET
/splitserve/kv/snapshot` (`KvSnapshot`) and `GET /splitserve/kv/events` (`KvEvents`, a long
poll; 410 when the reader must take a new snapshot), the `splitserve_kv_events_*` metrics, and
`kv_events`/`block_size` in `/splitserve/info` (a plain worker has no `/splitserve/info`: the
router reads its 404 as "no connector"; it probes the snapshot route instead).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import hashlib
import hmac
import json
import logging
import os
from argparse import Namespace
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi import Query as Param
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import Metric
from starlette.datastructures import Headers, State
from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.common.privatedir import remove_private_dir
from splitserve.common.vocab import Connector, Role
from splitserve.common.wire import ConnectorState, TransferRecord, WireError, WorkerInfo
from splitserve.config import ConnectorConfig, load_token
from splitserve.connector.framing import ProtocolError
from splitserve.connector.messages import Query
from splitserve.kvindex.blockset import BlockSet, Gone
from splitserve.kvindex.messages import EVENTS_PATH, SNAPSHOT_PATH
from splitserve.worker.chat_rendering import ChatRendering, chat_rendering
from splitserve.worker.kvrelay import (
    KV_EVENTS_DIR_ENV,
    Relay,
    RelayCollector,
    endpoints,
)
from splitserve.worker.load import LOAD_PATH, read_load
from splitserve.worker.metrics_page import metrics_app
from splitserve.worker.mooncake_settings import MooncakeSettings
from splitserve.worker.nixl_tuning import NixlTuning
from splitserve.worker.rank_listeners import (
    ConnectorCollector,
    RankListeners,
    summed,
    tensor_parallel_size,
)

log = logging.getLogger("splitserve.plugin")

def _extra_config(args: Namespace | None) -> dict[str, Any] | None:
    raw = getattr(args, "kv_transfer_config", None)
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = json.loads(raw)
    extra = raw.get("kv_connector_extra_config") if isinstance(raw, dict) else getattr(
        raw, "kv_connector_extra_config", None)
    return extra or None


def connector_config(args: Namespace | None) -> ConnectorConfig | None:
    extra = _extra_config(args)
    if not extra or Connector.SPLITSERVE not in extra:
        return None
    return ConnectorConfig.from_extra_config(extra)


def nixl_info(args: Namespace | None) -> WorkerInfo | None:
    """`/splitserve/info` of a worker running vLLM's NixlConnector the way splitserve starts it:
    its role and NIXL side channel (host and port from the environment vLLM reads them from)."""
    extra = _extra_config(args)
    if not NixlTuning.present(extra):
        return None
    import vllm.envs as envs

    from splitserve.common.engine import installed_vllm_version

    tuning = NixlTuning.from_extra_config(extra)
    return WorkerInfo(connector=Connector.NIXL, role=Role(tuning.role), transport="nixl",
                      kv_host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
                      kv_port=envs.VLLM_NIXL_SIDE_CHANNEL_PORT,
                      progress_delay_us=tuning.progress_delay_us,
                      vllm_version=installed_vllm_version())


def mooncake_info(args: Namespace | None) -> WorkerInfo | None:
    """`/splitserve/info` of a worker running vLLM's MooncakeConnector the way splitserve starts
    it: its role, protocol and bootstrap port (P's engine id is read from that server)."""
    extra = _extra_config(args)
    if not MooncakeSettings.present(extra):
        return None
    from splitserve.common.engine import installed_vllm_version

    settings = MooncakeSettings.from_extra_config(extra)
    host = getattr(args, "host", None) or "127.0.0.1"
    return WorkerInfo(connector=Connector.MOONCAKE, role=Role(settings.role),
                      transport=settings.protocol, kv_host=host,
                      kv_port=settings.bootstrap_port, vllm_version=installed_vllm_version())


class KvReport:
    """The worker's cache report: made when the plugin attaches its routes (the event sockets'
    directory is in the environment), started in `init_state` with the engine's block size."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.relay: Relay | None = None

    def start(self, engine_client: Any) -> None:
        cache = getattr(getattr(engine_client, "vllm_config", None), "cache_config", None)
        block_size = int(getattr(cache, "block_size", 0) or 0)
        if block_size < 1:
            self.relay = Relay.not_reporting(1, "the engine's block size is unknown")
        elif not getattr(cache, "enable_prefix_caching", False):
            # e.g. an MLA model on CPU: vLLM turns prefix caching off and stores no events
            self.relay = Relay.not_reporting(block_size, "the engine's prefix caching is off")
        else:
            pub, replay = endpoints(self.directory)
            self.relay = Relay(BlockSet(block_size), pub, replay)
        self.relay.start(asyncio.get_running_loop())
        atexit.register(self.close)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.stop()
        remove_private_dir(self.directory)

    @property
    def reporting(self) -> bool:
        return self.relay is not None and self.relay.reporting

    def info_fields(self) -> dict[str, Any]:
        """`WorkerInfo`'s `kv_events` and `block_size`."""
        if self.relay is None or not self.relay.reporting:
            return {"kv_events": False}
        return {"kv_events": True, "block_size": self.relay.blocks.block_size}

    def collector(self) -> RelayCollectorProxy:
        return RelayCollectorProxy(self)


class RelayCollectorProxy:
    """The relay's metrics once it runs (the registry is built before `init_state`)."""

    def __init__(self, report: KvReport) -> None:
        self.report = report

    def collect(self) -> Iterator[Metric]:
        if self.report.relay is not None:
            yield from RelayCollector(self.report.relay).collect()


def _attach_kv_routes(app: FastAPI, report: KvReport) -> None:
    """The two routes of `kvindex.messages` (TokenGuard checked the caller)."""

    def relay() -> Relay | None:
        return report.relay

    @app.get(SNAPSHOT_PATH)
    async def kv_snapshot() -> Response:
        r = relay()
        if r is None:
            return _error("the KV event relay is not started yet", "service_unavailable", 503)
        snap = r.snapshot()
        body = await asyncio.to_thread(lambda: json.dumps(snap.to_json()).encode())
        return Response(body, media_type="application/json")

    @app.get(EVENTS_PATH)
    async def kv_events(after: int = Param(ge=0), wait_s: float = Param(0.0, ge=0.0),
                        epoch: str | None = None) -> Response:
        r = relay()
        if r is None:
            return _error("the KV event relay is not started yet", "service_unavailable", 503)
        try:
            events = await r.events(after, wait_s, epoch)
        except Gone as exc:
            return _error(f"take a new snapshot: {exc}", "gone", 410)
        return JSONResponse(events.to_json())


class TokenGuard:
    """ASGI middleware: every HTTP request and WebSocket must carry the deployment token
    (constant-time check). An HTTP request without it gets 401 with an OpenAI-style body, a
    WebSocket is closed with 1008 (policy violation), before either reaches vLLM."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = hashlib.sha256(f"Bearer {token}".encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(hashlib.sha256(given.encode()).digest(), self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008,
                                "reason": "this worker requires the deployment token"})
                    return
                await _error("this worker requires the deployment token",
                             "authentication_error", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _attach_connector_routes(app: FastAPI, listeners: RankListeners,
                             advertise: Callable[[WorkerInfo], WorkerInfo]) -> None:
    """The routes of a worker running splitserve's connector: its info, state, transfer records
    and discard, each answered by the connector's ranks (TokenGuard checks the callers)."""

    async def ask_connector(question: Query,
                            respond: Callable[[list[dict[str, Any]]], JSONResponse],
                            every_rank: bool = True) -> JSONResponse:
        """The answers of the connector's ranks (rank 0's first; rank 0's alone unless
        `every_rank`) shaped by `respond` (TokenGuard already checked the caller); 503 if a
        rank does not answer, 502 if `respond` finds an answer malformed (`WireError`)."""
        try:
            answers = await asyncio.to_thread(listeners.ask, question, 2.0, every_rank)
        except (OSError, ProtocolError) as exc:
            return _error(f"connector unavailable: {exc}", "service_unavailable", 503)
        try:
            return respond(answers)
        except WireError as exc:
            return _error(f"connector answered out of shape: {exc}", "bad_gateway", 502)

    @app.get("/splitserve/info")
    async def info() -> JSONResponse:
        """Rank 0's identity (the router polls this every health round)."""
        return await ask_connector(Query("state"), lambda answers: JSONResponse(
            advertise(ConnectorState.from_json(answers[0]).info).to_json()), every_rank=False)

    @app.get("/splitserve/state")
    async def state() -> JSONResponse:
        """The worker's state: every rank's counts summed."""
        return await ask_connector(Query("state"), lambda answers: JSONResponse(
            summed(answers).to_json()))

    @app.get("/splitserve/transfers/{transfer_id}")
    async def transfer(transfer_id: str) -> JSONResponse:
        """Rank 0's record of the transfer (every rank keeps its own)."""
        def respond(answers: list[dict[str, Any]]) -> JSONResponse:
            if "error" in answers[0]:
                return _error(f"unknown transfer {transfer_id}", "not_found", 404)
            return JSONResponse(TransferRecord.from_json(answers[0]).to_json())

        return await ask_connector(Query("transfer", transfer_id), respond, every_rank=False)

    @app.delete("/splitserve/transfers/{transfer_id}")
    async def discard(transfer_id: str) -> JSONResponse:
        """Free staged KV no decode request will claim (or refuse its push if not begun),
        on every rank: `{"discarded": true}` if any rank held some."""
        def respond(answers: list[dict[str, Any]]) -> JSONResponse:
            if "error" in answers[0]:  # e.g. a P: no staged KV to discard
                return _error(f"cannot discard {transfer_id}: {answers[0]['error']}",
                              "invalid_request_error", 409)
            return JSONResponse({"discarded": any(a.get("discarded") for a in answers)})

        return await ask_connector(Query("discard", transfer_id), respond)


class SplitserveEndpointPlugin:
    name = "splitserve"
    required_tasks = None

    def __init__(self) -> None:
        self.kv: KvReport | None = None
        self.chat: ChatRendering | None = None  # set in `init_state`

    def attach_router(self, app: FastAPI) -> None:
        token = load_token(required=False)
        if token:
            app.add_middleware(TokenGuard, token=token)

        @app.get(LOAD_PATH)
        async def load() -> JSONResponse:
            return JSONResponse(read_load().to_json())

        kv_dir = os.environ.get(KV_EVENTS_DIR_ENV)
        if kv_dir and not token:
            log.warning("KV cache events are not relayed: this worker has no deployment token")
        elif kv_dir:
            self.kv = KvReport(kv_dir)
            _attach_kv_routes(app, self.kv)
        kv = self.kv

        args = getattr(app.state, "args", None)
        pulled = nixl_info(args) or mooncake_info(args)  # vLLM's connectors: D pulls from P
        if pulled is not None:
            @app.get("/splitserve/info")
            async def pulling_worker_info() -> JSONResponse:
                assert pulled is not None
                return JSONResponse(self.advertise(pulled).to_json())
            _attach_metrics(app, *([kv.collector()] if kv else []))
            return
        cfg = connector_config(args)
        if cfg is None:
            _attach_metrics(app, *([kv.collector()] if kv else []))
            return
        if not token:
            raise RuntimeError("a worker with splitserve's connector needs the deployment token")
        listeners = RankListeners(cfg, token, tensor_parallel_size(args))
        _attach_metrics(app, ConnectorCollector(listeners), *([kv.collector()] if kv else []))

        _attach_connector_routes(app, listeners, self.advertise)

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        if engine_client is None:
            return
        if self.kv is not None:
            self.kv.start(engine_client)
        try:
            self.chat = chat_rendering(engine_client, args)
        except Exception:  # a model without a tokenizer or template: the router renders none
            log.warning("cannot tell how this worker renders chats", exc_info=True)

    def advertise(self, info: WorkerInfo) -> WorkerInfo:
        """`info` with what the API server adds: its cache report (`kv_events`, `block_size`)
        and how it renders chats."""
        if self.kv is not None:
            info = dataclasses.replace(info, **self.kv.info_fields())
        if self.chat is not None:
            info = dataclasses.replace(info, chat_format=self.chat.content_format,
                                       chat_template_sha256=self.chat.template_sha256)
        return info


def _error(message: str, kind: str, code: int) -> JSONResponse:
    """An OpenAI-style error body with its HTTP status."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}}, code)


def _attach_metrics(app: FastAPI, *collectors: Any) -> None:
    """Serve vLLM's registry plus our families (the connector's, the KV event relay's) at the
    existing /metrics mount."""
    if not collectors:
        return
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    registry = get_prometheus_registry()
    for collector in collectors:
        registry.register(collector)
    for route in app.routes:
        if isinstance(route, Mount) and route.path == "/metrics":
            route.app = metrics_app(registry)  # collectors run off the event loop
            if hasattr(route, "_base_app"):
                route._base_app = route.app
