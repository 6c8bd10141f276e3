"""One router's state, built at startup and closed at shutdown: its HTTP clients, worker
registry, metrics, tokenizer and the two request paths. Nothing of it is process-global."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from splitserve.common.vocab import Pool
from splitserve.router.cacheview import INDEX_BYTES_PER_BLOCK, CacheView
from splitserve.router.config import RouterConfig
from splitserve.router.flow import Flow
from splitserve.router.health import HealthLoop
from splitserve.router.http import new_session
from splitserve.router.legs import LegProtocols, leg_protocols
from splitserve.router.metrics import RouterMetrics
from splitserve.router.peers import Peers
from splitserve.router.policy import Picker
from splitserve.router.prompt import (
    chat_default_max_tokens,
    kv_bytes_per_token,
    load_tokenizer,
    own_chat_template_sha256,
    prompt_chars_limit,
    workers_chat_format,
)
from splitserve.router.registry import Registry
from splitserve.router.whole import Passthrough
from splitserve.router.worker import Worker

log = logging.getLogger("splitserve.router")


@dataclass
class RouterState:
    cfg: RouterConfig
    token: str | None
    api_key: str | None
    session: aiohttp.ClientSession  # the one session to workers: health loop and legs
    registry: Registry
    checks: HealthLoop
    protocols: LegProtocols  # each connector's side of the legs and of the health checks
    metrics: RouterMetrics
    flow: Flow
    whole: Passthrough
    model: dict[str, Any]
    tokenizer: Any
    prompt_chars_limit: int | None = None  # longer string prompts go to P untokenized
    chat_template_sha256: str | None = None  # what the router renders chats from (`prompt`)
    chat_max_tokens: int | None = None  # a chat's budget when it gives none, beyond the context
    health: asyncio.Task[None] | None = None  # the health loop's task
    inflight: int = 0  # admitted client requests not finished yet (`endpoints.Admission`)
    cache: CacheView | None = None  # every worker's cached blocks (`cacheview`)
    peers: Peers | None = None  # the other routers' open legs (`peers`)

    def chat_format(self) -> str | None:
        """How the P and D workers in rotation render chats (`prompt.workers_chat_format`)."""
        return workers_chat_format(
            (w.info for pool in (Pool.PREFILL, Pool.DECODE) for w in self.registry.routable(pool)),
            self.chat_template_sha256)

    def describe(self, worker: Worker) -> dict[str, Any]:
        """`worker` in `/workers` and the admin answers (with its cache: sync state, blocks
        and tokens the index holds for it)."""
        out = worker.describe(self.protocols.endpoint(worker))
        out["cache"] = None if self.cache is None else self.cache.describe(worker.url)
        return out


async def open_state(cfg: RouterConfig, token: str | None, api_key: str | None,
                     startup_timeout_s: float) -> RouterState:
    """Wait (up to `startup_timeout_s`) for a worker to name the model, check every worker
    once, load the tokenizer, and start the health loop."""
    session = new_session(cfg, token)  # sends the token on every request
    registry = Registry(cfg)
    protocols = leg_protocols(session, token, cfg.kv_transport)
    checks = HealthLoop(cfg, registry, session, token, protocols)
    metrics = RouterMetrics()
    metrics.watch_workers(registry.all)
    # follows every worker's cache report from now on, while the rest starts
    cache = CacheView(registry, session, metrics)
    metrics.watch_cache(registry.all, cache.describe,
                        lambda: (len(cache.index), len(cache.index) * INDEX_BYTES_PER_BLOCK))
    try:
        model = await _served_model(checks, startup_timeout_s)
        await checks.check_all()
        model_dir = cfg.model_dir or model.get("root")
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
    except BaseException:  # timed out, no tokenizer, cancelled: nothing started stays open
        await cache.close()
        await session.close()
        raise
    max_model_len = model.get("max_model_len")
    picker = Picker(cfg.prefill_policy, cfg.decode_policy, cfg.max_inflight_per_worker,
                    weights=cfg.cache_weights)
    flow = Flow(cfg, registry, picker, metrics, session, model["id"],
                kv_bytes_per_token(model_dir), max_model_len, protocols, cache)
    whole = Passthrough(cfg, registry, picker, metrics, session)
    st = RouterState(cfg, token, api_key, session, registry, checks, protocols, metrics, flow,
                     whole, model, tokenizer, prompt_chars_limit(tokenizer, max_model_len),
                     own_chat_template_sha256(tokenizer), chat_default_max_tokens(model_dir),
                     cache=cache)
    st.peers = Peers(registry, session, cfg.peers, cfg.health_interval_s, cfg.health_timeout_s)
    st.peers.start()
    st.health = asyncio.create_task(checks.run())
    log.info("router on %s:%d serving %s", cfg.host, cfg.port, model["id"])
    return st


async def _served_model(checks: HealthLoop, timeout_s: float) -> dict[str, Any]:
    """The first worker's answer to /v1/models, asked every 0.5 s until one answers
    (RuntimeError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await checks.model()
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def close_state(st: RouterState) -> None:
    if st.peers is not None:
        await st.peers.close()
    if st.cache is not None:
        await st.cache.close()
    if st.health is not None:
        st.health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await st.health
    await st.session.close()
