"""The KV hand-off from a P-worker to a D-worker in the simulated run (`simulator.Simulation`
inherits it), over either connector, and the run's event kinds.

- splitserve's connector: when P's last prefill step ends, the KV is already crossing the
  link layer by layer (`costmodel.transfer_arrival`); the leg joins D at max(t1 + hop, arrival).
- NIXL (`SimConfig.connector == "nixl"`): the leg reaches D's scheduler at t1 + hop +
  `pull_request_s`; D's next step (at once if D is idle) posts the READ of P's whole blocks
  (`costmodel.pull_arrival`); the leg joins D when they are in.

Either way P holds the prompt's KV until the transfer leaves the link (a P blocked on KV is
woken then), and `kv_transfer_s` is the KV's arrival less the end of P's prefill.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from splitserve.sim.costmodel import pull_arrival, transfer_arrival
from splitserve.sim.workerstate import KV_WAIT, Worker, next_boundary

if TYPE_CHECKING:
    from splitserve.sim.simulator import Simulation

# An event on the run's heap is a bare tuple, not a NamedTuple (which made heap pushes and
# pops ~50 % slower, several per cent of a million-request run):
#   (time, seq: the push order, breaking ties; kind; subject; version)
# kind _EV_STEP: subject = the worker whose step (or segment) ends, version = its `version`
# then (a superseded step is skipped); _EV_JOIN: subject = the request whose decode leg
# reaches its D; _EV_OVERLAY: subject = the request the overlay scheduled it for; _EV_LEG:
# subject = the request whose pulled (NIXL) leg reaches D's scheduler.
Event = tuple[float, int, int, int, int]
_EV_STEP, _EV_JOIN, _EV_OVERLAY, _EV_LEG = 0, 1, 2, 3


class Handoff:
    """The hand-off's steps, as methods of the run (`Simulation`) they act on."""

    def _prefilled(self: Simulation, wi: int, w: Worker, r: int, t: float) -> None:
        """P finished request r's prompt at t: emit t1, start the KV transfer."""
        hop = self.cfg.router_hop_s
        t1 = self.overlay.t1(t + hop, wi, r)
        self.t1[r] = t1
        w.load -= self.prompt_lens[r]
        if self.output_lens[r] == 1:
            self.finish[r] = t1
            w.kv_used -= self.prompt_lens[r]
            return
        nbytes = self.kvbpt * self.prompt_lens[r]
        free = self.shared_free if self.cfg.shared_link else self.link_free[wi]
        if self.overlay.active:
            self.overlay.t1_emitted(r, t1)
        ready = self.overlay.join_ready(t1 + hop, r)
        if self.pull:  # the READ waits for D's leg: `_post_read`
            self.prefill_of[r], self.kv_transfer[r] = wi, t
            self._push(ready + self.cfg.pull_request_s, _EV_LEG, r, 0)
            return
        arrive, free = transfer_arrival(self.link, nbytes, self.layers, self.prefill_start[r], t,
                                        self.cfg.overlap, free)
        if self.cfg.shared_link:
            self.shared_free = free
        else:
            self.link_free[wi] = free
        heapq.heappush(w.kv_release, (free, self.prompt_lens[r]))
        self.kv_transfer[r] = arrive - t
        self._push(max(arrive, ready), _EV_JOIN, r, 0)

    def _post_read(self: Simulation, r: int, t: float) -> None:
        """Request r's pulled leg reached its D's scheduler at t: D's next step (now, if D is
        idle) posts the READ of P's blocks; P holds them until it ends (a P blocked on KV is
        woken then); the leg joins D when they are in."""
        d, pi = self.D[self.decode_of[r]], self.prefill_of[r]
        w = self.P[pi]
        free = self.shared_free if self.cfg.shared_link else self.link_free[pi]
        post = next_boundary(d, t) if d.busy else t
        arrive, free = pull_arrival(self.link, self.kvbpt * self.prompt_lens[r], post, free)
        if self.cfg.shared_link:
            self.shared_free = free
        else:
            self.link_free[pi] = free
        heapq.heappush(w.kv_release, (free, self.prompt_lens[r]))
        if not w.busy and w.queue:
            w.kind = KV_WAIT
            self._schedule(pi, w, max(t, w.kv_release[0][0]))
        self.kv_transfer[r] = arrive - self.kv_transfer[r]
        self._push(arrive, _EV_JOIN, r, 0)
