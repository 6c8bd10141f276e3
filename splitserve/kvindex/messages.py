"""A worker's report of its prefix cache, as the router reads it (frozen, validated types;
`from_json` raises `common.wire.WireError` on anything malformed).

Routes (on every worker that reports its cache; behind the deployment token like every worker
route):
- `GET /splitserve/kv/snapshot` -> `KvSnapshot`: every block key the engine holds now, and the
  sequence number of the last change it includes.
- `GET /splitserve/kv/events?after=SEQ&wait_s=W[&epoch=E]` -> `KvEvents`: the changes after
  `SEQ`, in order, waiting up to `W` seconds (at most `MAX_WAIT_S`) for one when there is none
  yet. `410 Gone` when changes after `SEQ` are no longer retained (the reader fell behind), when
  `SEQ` is ahead of the worker, when `E` is given and is not the worker's epoch, and whenever
  the worker's view is not exact: take a new snapshot.

Contract: applying a snapshot and then every change after its `seq` gives exactly the set of
keys the engine holds. `epoch` names one exact view of the engine: a new epoch (the worker
restarted, or its relay lost the engine's stream and started over) invalidates everything read
before. A snapshot with `exact: false` says the worker cannot vouch for what its engine holds
(prefix caching is off, or the relay lost events it could not replay); its keys are empty and
the reader routes that worker by load until a snapshot is exact again.
Keys are `kvindex.keys` block keys of `block_size`-token blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self

from splitserve.common.wire import WireError

SNAPSHOT_PATH = "/splitserve/kv/snapshot"
EVENTS_PATH = "/splitserve/kv/events"
MAX_WAIT_S = 30.0  # the longest long poll a worker holds open (a larger wait_s is clamped)


def _obj(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise WireError(f"{what} must be a JSON object, got {type(raw).__name__}")
    return raw


def _nonneg(raw: dict[str, Any], key: str, what: str) -> int:
    value = raw.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise WireError(f"{what}.{key} must be a non-negative integer, got {value!r}")


def _keys(raw: dict[str, Any], key: str, what: str) -> tuple[int, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**64 for k in value):
        raise WireError(f"{what}.{key} must be a list of 64-bit block keys")
    return tuple(value)


def _epoch(raw: dict[str, Any], what: str) -> str:
    value = raw.get("epoch")
    if not isinstance(value, str) or not value:
        raise WireError(f"{what}.epoch must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class KvSnapshot:
    """Every block key the worker's engine holds, as of change `seq` (0: none yet). `exact`
    False: the worker cannot say what its engine holds (`reason` says why); `keys` is empty."""

    epoch: str
    seq: int
    block_size: int
    keys: tuple[int, ...] = ()
    exact: bool = True
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.seq < 0:
            raise WireError("snapshot needs block_size >= 1 and seq >= 0")
        if not self.exact and self.keys:
            raise WireError("a snapshot that is not exact has no keys")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "snapshot")
        exact = raw.get("exact", True)
        if not isinstance(exact, bool):
            raise WireError("snapshot.exact must be a boolean")
        reason = raw.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise WireError("snapshot.reason must be a string")
        return cls(epoch=_epoch(raw, "snapshot"), seq=_nonneg(raw, "seq", "snapshot"),
                   block_size=_nonneg(raw, "block_size", "snapshot"),
                   keys=_keys(raw, "keys", "snapshot"), exact=exact, reason=reason)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"epoch": self.epoch, "seq": self.seq,
                               "block_size": self.block_size, "keys": list(self.keys),
                               "exact": self.exact}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class KvChange:
    """One batch of the engine's cache events: `cleared` (every block dropped) applies first,
    then `removed`, then `stored`. `ts`: when the worker received it (its clock, epoch s)."""

    seq: int
    ts: float
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "change")
        ts = raw.get("ts")
        if (not isinstance(ts, int | float) or isinstance(ts, bool)
                or abs(ts) > 1e12 or not math.isfinite(ts)):
            raise WireError(f"change.ts must be a time in epoch seconds, got {ts!r:.40}")
        cleared = raw.get("cleared", False)
        if not isinstance(cleared, bool):
            raise WireError("change.cleared must be a boolean")
        return cls(seq=_nonneg(raw, "seq", "change"), ts=float(ts),
                   stored=_keys(raw, "stored", "change"),
                   removed=_keys(raw, "removed", "change"), cleared=cleared)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "stored": list(self.stored),
                "removed": list(self.removed), "cleared": self.cleared}


@dataclass(frozen=True)
class KvEvents:
    """The changes after the reader's `after`, in increasing `seq` with no gap; `seq` is the
    worker's latest (equal to the last change's, or to `after` when none came in time)."""

    epoch: str
    seq: int
    block_size: int
    changes: tuple[KvChange, ...] = ()

    def __post_init__(self) -> None:
        for a, b in zip(self.changes, self.changes[1:], strict=False):
            if b.seq != a.seq + 1:
                raise WireError(f"changes must be consecutive, got seq {a.seq} then {b.seq}")

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        raw = _obj(raw, "events")
        changes = raw.get("changes", [])
        if not isinstance(changes, list):
            raise WireError("events.changes must be a list")
        return cls(epoch=_epoch(raw, "events"), seq=_nonneg(raw, "seq", "events"),
                   block_size=_nonneg(raw, "block_size", "events"),
                   changes=tuple(KvChange.from_json(c) for c in changes))

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": self.seq, "block_size": self.block_size,
                "changes": [c.to_json() for c in self.changes]}
