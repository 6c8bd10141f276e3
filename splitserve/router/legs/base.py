"""The leg protocol: how one request's KV goes from its P leg to its D leg over the workers'
connector. `Flow` runs the two legs and calls a `LegProtocol` for everything connector-specific;
retries, resumption, admission, metrics and request ids stay in `Flow`, once, for every connector.

Contract, in the order `Flow` calls it (one `Transfer` per P attempt):

1. **P's leg.** `open(p, d, transfer_id)` returns the attempt's `Transfer`, whose
   `prefill_params` go into P's body as `kv_transfer_params` (the body is otherwise the same
   for every connector: the prompt, `max_tokens: 1`, `return_token_ids`), or None when this
   pair cannot move KV (then D recomputes the prompt: exact, only slower). `transfer_id` is
   fresh per attempt and starts with the request id.
2. **What D needs of P's answer.** `received(transfer, answer)` is called with P's whole
   response body (HTTP 200) and sets `transfer.decode_params`, the `kv_transfer_params` of D's
   first leg.
3. **What D is sent.** `decode_start(transfer, produced)` gives D's `kv_transfer_params`
   and how many of `produced` (the tokens the client already has: t1) D must generate again.
   With `replayed = 0`, D is sent P's `prompt_token_ids` + `produced` and generates the token
   after t1; with `replayed = k`, D's prompt ends k tokens earlier, D generates those k again,
   and the router checks each against what the client has and drops it (a mismatch fails the
   leg, which is resumed by recomputation). D's budget (`max_tokens`, `min_tokens`) is counted
   from the end of its prompt.
4. **Abandoning a leg.** `release(transfer)` says no D leg will claim this transfer: P failed
   after it may have sent KV, the request ended at t1, or the client left between the legs. It
   frees the KV wherever the connector holds it (on D's staging area, on P's blocks), in the
   background, never raises, and is idempotent. A D leg that started claims the transfer: its
   KV is the engine's from then on, freed when the request ends or is aborted (closing the
   leg's connection aborts it in vLLM). A resumed D leg never reads a transfer (it recomputes
   from the prompt and every token produced), so no connector sees a second claim.
5. **Timings.** `record(transfer, at_url)` is the connector's record of the transfer (a
   `wire.SideRecord`: `bytes`, `duration_s`, `tail_s`, `wire_s`, `gbps`, `load_s`, `status`,
   `first_byte_s`, ...), or None;
   `record_final(record)` says whether it can no longer change. Best effort: never raises.

6. **Legs sent at once.** A protocol whose `concurrent` is True has D's first leg sent together
   with P's (one per P attempt), before P answers: `open` must then set `decode_params`, D is
   sent the request's own prompt and budget with them, and `decode_start` says how many tokens
   D generates again (`replayed`, counted from P's t1). That D leg is closed (aborting it in
   vLLM) whenever the P attempt fails or the request ends at t1, before `release` is called.

7. **What the health loop asks of a worker.** `endpoint(info)` is the worker as a KV target,
   from its `/splitserve/info` (shown in `/workers`; None: it has no KV endpoint).
   `poll_staging(get)` is called on every good check of a D that speaks this connector, with
   `get(path) -> (status, body)` over the router's session to that worker; it returns the
   connector's staging (`worker.Staging`, which the `load` policy reads) or None (none kept, or
   not readable now). It may raise the transport errors and `ValueError`: the check logs them
   and stays good. `poll_prefill(p)` is called on every good check of a P that speaks this
   connector (what `open` needs to know of P that P's info does not say); it never raises.

Which implementation drives a pair: the `connector` that both workers advertise in
`/splitserve/info` (`LegProtocols.for_pair`; `WorkerInfo` reads an absent key as
`splitserve`). A pair whose connectors differ, or that the router has no implementation for,
moves no KV; nor does a worker whose info is not known (a plain vLLM worker).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from splitserve.common.vocab import Connector
from splitserve.common.wire import SideRecord, WorkerInfo
from splitserve.router.worker import Staging, Worker

# GET one route of the worker being checked: (status, body)
Getter = Callable[[str], Awaitable[tuple[int, bytes]]]


@dataclass
class Transfer:
    """One P attempt's KV handoff, from P's body to D's claim or its release."""

    via: LegProtocol
    transfer_id: str
    prefill: Worker
    decode: Worker
    prefill_params: dict[str, Any]  # P's `kv_transfer_params`
    decode_params: dict[str, Any] | None = None  # D's, set by `received` from P's answer
    released: bool = False  # `release` ran: no D leg may claim it


@dataclass(frozen=True)
class DecodeStart:
    """D's first leg: its `kv_transfer_params`, and how many of the tokens the client already
    has are left out of D's prompt for D to generate again (`replayed`)."""

    kv_transfer_params: dict[str, Any] | None
    replayed: int = 0

    def __post_init__(self) -> None:
        if self.replayed < 0:
            raise ValueError("replayed must not be negative")


def advertised_endpoint(info: WorkerInfo) -> dict[str, Any] | None:
    """A worker's KV host, port, engine id and transport as its info advertises them (the P
    leg's `kv_transfer_params`, less the transfer's own fields); None without a KV endpoint."""
    if not info.kv_port:
        return None
    endpoint: dict[str, Any] = {"remote_host": info.kv_host, "remote_port": info.kv_port,
                                "remote_engine_id": info.engine_id}
    if info.transport:
        endpoint["transport"] = info.transport
    return endpoint


class LegProtocol(ABC):
    """One connector's side of the two legs (see the module docstring for the contract)."""

    connector: ClassVar[Connector]
    concurrent: ClassVar[bool] = False  # D's first leg goes out with P's (contract, 6)

    def endpoint(self, info: WorkerInfo) -> dict[str, Any] | None:
        """The worker as the target of a KV push or pull (default: `advertised_endpoint`)."""
        return advertised_endpoint(info)

    async def poll_staging(self, get: Getter) -> Staging | None:
        """The connector's staging on a D, read on each good check; None: it keeps none."""
        return None

    async def poll_prefill(self, p: Worker) -> None:
        """Learn what `open` needs of P beyond its info, on each good check of P (default:
        nothing)."""
        return None

    @abstractmethod
    def open(self, p: Worker, d: Worker, transfer_id: str, d_cached: int = 0
             ) -> Transfer | None:
        """P's `kv_transfer_params` for pushing or offering this prompt's KV to `d`.
        `d_cached`: the prompt tokens the router expects D's prefix cache to hold (a multiple of
        D's block size; 0: none). A connector that can move only the KV D lacks uses it; the
        expectation may be stale, so D must recompute, never misread, what it turns out to
        lack."""

    @abstractmethod
    def received(self, transfer: Transfer, answer: dict[str, Any]) -> None:
        """Keep what D needs of P's answer in `transfer.decode_params`."""

    def decode_start(self, transfer: Transfer, produced: list[int]) -> DecodeStart:
        """D continues after every token produced, loading the transfer."""
        return DecodeStart(transfer.decode_params)

    @abstractmethod
    def release(self, transfer: Transfer) -> None:
        """No D leg will claim `transfer`: free its KV (background, idempotent)."""

    async def record(self, transfer: Transfer, at_url: str,
                     timeout_s: float = 0.5) -> SideRecord | None:
        """The connector's record of the transfer, asked of the worker at `at_url`."""
        return None

    def record_final(self, record: SideRecord) -> bool:
        """Whether `record` describes a transfer that is over."""
        return True


class LegProtocols:
    """The implementations the router has, by connector name; picks one per P/D pair."""

    def __init__(self, *protocols: LegProtocol) -> None:
        self.by_connector: dict[str, LegProtocol] = {
            proto.connector: proto for proto in protocols}

    def for_worker(self, w: Worker) -> LegProtocol | None:
        """The protocol of the connector `w` advertises; None when its info is not known (a
        plain vLLM worker) or the router has no implementation of that connector."""
        connector = w.identity.connector
        return None if connector is None else self.by_connector.get(connector)

    def for_pair(self, p: Worker, d: Worker) -> LegProtocol | None:
        """The protocol both workers speak, or None (D recomputes)."""
        if p.identity.connector != d.identity.connector:
            return None
        return self.for_worker(d)

    def endpoint(self, w: Worker) -> dict[str, Any] | None:
        """`w` as a KV target, as its connector's protocol reads its info (`/workers`)."""
        proto = self.for_worker(w)
        return None if proto is None or w.info is None else proto.endpoint(w.info)


def drop_replayed(token_ids: list[int], produced: list[int], pending: int) -> list[int]:
    """D's `token_ids` less the first `pending` of them, which must repeat the last `pending`
    tokens of `produced` (what the client already has); ValueError when they do not."""
    n = min(pending, len(token_ids))
    start = len(produced) - pending
    if token_ids[:n] != produced[start:start + n]:
        raise ValueError(f"D replayed {token_ids[:n]} where the client has "
                         f"{produced[start:start + n]}")
    return token_ids[n:]
