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

from splitserve.router.config import RouterConfig
from splitserve.router.flow import Flow
from splitserve.router.health import Registry
from splitserve.router.http import new_session
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import Picker
from splitserve.router.prompt import kv_bytes_per_token, load_tokenizer
from splitserve.router.whole import Passthrough

log = logging.getLogger("splitserve.router")


@dataclass
class RouterState:
    cfg: RouterConfig
    token: str | None
    api_key: str | None
    session: aiohttp.ClientSession  # the one session to workers: health loop and legs
    registry: Registry
    metrics: RouterMetrics
    flow: Flow
    whole: Passthrough
    model: dict[str, Any]
    tokenizer: Any
    health: asyncio.Task[None] | None = None  # the registry's health loop
    inflight: int = 0  # admitted client requests not finished yet (`endpoints.Admission`)


async def open_state(cfg: RouterConfig, token: str | None, api_key: str | None,
                     startup_timeout_s: float) -> RouterState:
    """Wait (up to `startup_timeout_s`) for a worker to name the model, check every worker
    once, load the tokenizer, and start the health loop."""
    session = new_session(cfg, token)  # sends the token on every request
    registry = Registry(cfg, session, token)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            model = await registry.model()
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                await session.close()
                raise
            await asyncio.sleep(0.5)
    await registry.check_all()
    model_dir = cfg.model_dir or model.get("root")
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
    metrics = RouterMetrics()
    metrics.watch_workers(lambda: registry.workers.values())
    picker = Picker(cfg.prefill_policy, cfg.decode_policy, cfg.max_inflight_per_worker)
    flow = Flow(cfg, registry, picker, metrics, session, model["id"],
                kv_bytes_per_token(model_dir), model.get("max_model_len"))
    whole = Passthrough(cfg, registry, picker, metrics, session)
    st = RouterState(cfg, token, api_key, session, registry, metrics, flow, whole,
                     model, tokenizer)
    st.health = asyncio.create_task(registry.run())
    log.info("router on %s:%d serving %s", cfg.host, cfg.port, model["id"])
    return st


async def close_state(st: RouterState) -> None:
    if st.health is not None:
        st.health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await st.health
    await st.session.close()
