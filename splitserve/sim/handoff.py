"""The KV links a disaggregated run's hand-offs cross (`KvLinks`): one FIFO link per P-worker,
or one shared by the whole cluster.

- splitserve's connector (`push`): when P's last prefill step ends, the KV is already crossing
  the link layer by layer (`costmodel.transfer_window`); the leg joins D at
  max(t1 + hop, arrival).
- NIXL (`pull`, `SimConfig.connector == "nixl"`): D's step that posts the READ of P's whole
  blocks starts it (`costmodel.pull_arrival`); the leg joins D when they are in.

Either way the link is busy until the transfer leaves it, and P holds the prompt's KV until
then. The loop that calls these (`simulator.Simulation`) owns the requests and the workers;
this module owns only the links' state.
"""

from __future__ import annotations

from splitserve.sim.costmodel import TransferLink, pull_arrival, transfer_window


class KvLinks:
    """The links' FIFO state. Invariant: a transfer starts no earlier than its link is free,
    and `push`/`pull` leave the link free when the transfer has left it."""

    __slots__ = ("link", "layers", "overlap", "shared", "free", "shared_free")

    def __init__(self, link: TransferLink, n_prefill: int, layers: int, overlap: bool,
                 shared: bool) -> None:
        self.link, self.layers, self.overlap, self.shared = link, layers, overlap, shared
        self.free = [0.0] * n_prefill  # per P-worker: when its own link is free
        self.shared_free = 0.0  # `shared`: when the cluster's one link is free

    def _take(self, p: int, free: float) -> None:
        if self.shared:
            self.shared_free = free
        else:
            self.free[p] = free

    def push(self, p: int, nbytes: float, prefill_start: float, prefill_end: float
             ) -> tuple[float, float, float]:
        """P-worker p pushes `nbytes` of KV for a prompt prefilled from `prefill_start` to
        `prefill_end`: (when its first bytes start moving on the link, when it is all at D,
        when the link is free again)."""
        free = self.shared_free if self.shared else self.free[p]
        start, arrive, free = transfer_window(self.link, nbytes, self.layers, prefill_start,
                                              prefill_end, self.overlap, free)
        self._take(p, free)
        return start, arrive, free

    def pull(self, p: int, nbytes: float, post: float) -> tuple[float, float]:
        """D reads `nbytes` of P-worker p's KV from `post` on: (when it is all at D, when the
        link is free again)."""
        free = self.shared_free if self.shared else self.free[p]
        arrive, free = pull_arrival(self.link, nbytes, post, free)
        self._take(p, free)
        return arrive, free
