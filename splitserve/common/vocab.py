"""The words every part of splitserve shares, each defined once: a worker's engine role, the
router's pools, the KV connectors, and a transfer's status.

Each is a `StrEnum`, so a member compares equal to its value, serialises to it in JSON, and
parses from it with `Enum(value)` (a `ValueError` names a bad one).
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a worker's engine does with a request's KV (`splitserve worker --role`)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class Pool(StrEnum):
    """The router's pools: a worker serves in one (a `both` worker may be added to P and D)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def worker_role(self) -> Role | None:
        """The role a worker started for this pool runs: P's and D's their own; None for a
        colocated worker (plain vLLM, no connector)."""
        return None if self is Pool.COLOCATED else Role(self.value)


class Connector(StrEnum):
    """The KV connector a pair of workers moves KV with.

    `splitserve`: this project's layer-wise push (tcp or shm; vLLM-CPU's paged layout and the
    CUDA layouts). `nixl`: vLLM's NixlConnector (D pulls P's blocks; RDMA on GPU clusters).
    `mooncake`: vLLM's MooncakeConnector (both legs sent at once; D pulls P's blocks over the
    Mooncake transfer engine, tcp or rdma)."""

    SPLITSERVE = "splitserve"
    NIXL = "nixl"
    MOONCAKE = "mooncake"


class TransferStatus(StrEnum):
    """One transfer's status on one worker (its record's `status`).

    `open` -> `complete` (D: every byte staged and verified; P: D acknowledged) -> one terminal
    status. A transfer can also end straight from `open`. Terminal statuses never change.
    `refused` is a transfer D declined at BEGIN (staging full, duplicate id): no bytes moved.
    `aborted`: P gave up on a transfer D had opened (its copy failed, or it was cancelled)."""

    OPEN = "open"
    COMPLETE = "complete"
    LOADED = "loaded"
    FAILED = "failed"
    REFUSED = "refused"
    ABORTED = "aborted"
    EXPIRED = "expired"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """No later status can follow this one."""
        return self not in (TransferStatus.OPEN, TransferStatus.COMPLETE)


TERMINAL_STATUSES: frozenset[TransferStatus] = frozenset(s for s in TransferStatus if s.terminal)


def values(enum: type[StrEnum]) -> tuple[str, ...]:
    """An enum's values in definition order (argparse `choices`, error messages)."""
    return tuple(member.value for member in enum)
