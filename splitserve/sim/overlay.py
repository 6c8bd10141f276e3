"""The simulator's one seam for effects beyond the workers' own step costs: an `Overlay`.

The event loop (`simulator.Simulation`) models a cluster whose parts do not share hardware:
routers, P and D queues, continuous batching, a token budget, KV capacity and transfer links.
Anything else a deployment costs — e.g. router, client and workers sharing a few CPU cores
(`splitserve.sim.calibration.overlay.SharedCoreOverlay`) — enters only through the hooks below,
at fixed points of the loop. `Overlay()` itself is the null overlay: every hook leaves the
model as it is, so a simulation with it is the plain cluster model.

Hooks come in two kinds:

- *build-time and per-request* hooks (`prefill_cost`, `decode_cost`, `t1`, `join_ready`,
  `gap_jitter_s`), always called;
- *per-event* hooks on D-workers (`arrived` … `idle`), called only when `active` is True, so
  that the null overlay costs the hot loop nothing. D-workers are numbered 0..n_decode−1 and
  P-workers 0..n_prefill−1 in these hooks.

An overlay may change the simulation only through the methods the loop hands it in `bind`
(`Simulation.extend_step`, `Simulation.cut_segment`, `Simulation.push_overlay_event`), so the
loop's invariants (one scheduled step per busy worker, segments cut at step boundaries) hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.sim.costmodel import Bins, DecodeCost, PrefillCost

if TYPE_CHECKING:
    from splitserve.sim.simulator import Simulation


class Overlay:
    """The null overlay; subclasses override the hooks they model."""

    #: True: the loop calls the per-event hooks; False: it never does
    active: bool = False
    #: the step-gap jitter the run's ITL carries instead of the profile's (None: the profile's)
    gap_jitter_s: Bins | None = None

    def bind(self, sim: Simulation) -> None:
        """Called once before the run, with the simulation the hooks act on."""

    def prefill_cost(self, base: PrefillCost) -> PrefillCost:
        """A P-worker's prefill step cost, given the profile's."""
        return base

    def decode_cost(self, base: DecodeCost) -> DecodeCost:
        """A D-worker's decode step cost, given the profile's."""
        return base

    def t1(self, at: float, p: int, r: int) -> float:
        """When request r's first token reaches the client, given `at` = the end of its last
        prefill step on P-worker p plus the router hop. Must be >= `at`."""
        return at

    def join_ready(self, at: float, r: int) -> float:
        """The earliest time request r's decode leg can join its D-worker, given `at` = t1 plus
        the router hop (the KV's arrival bounds it separately). Must be >= `at`."""
        return at

    # per-event hooks: called only while `active` ------------------------------------------
    def arrived(self, d: int, t: float) -> None:
        """A request assigned to D-worker d arrived at the router at t."""

    def overlay_event(self, r: int, t: float) -> None:
        """An event this overlay scheduled with `Simulation.push_overlay_event(t, r)` fired."""

    def t1_emitted(self, r: int, t1: float) -> None:
        """Request r's t1 is `t1` and its decode leg is on its way to D."""

    def admitted(self, d: int, others: int) -> None:
        """D-worker d admitted a decode leg; `others`: its streams besides that one."""

    def finished(self, d: int, batch: int) -> None:
        """A stream ended on D-worker d, leaving `batch` streams (called only if batch > 0)."""

    def prefilling(self, p: int, busy: bool, t: float) -> None:
        """P-worker p's step planned at t prefills (`busy`) or not."""

    def decode_step(self, d: int, batch: int) -> tuple[float, float | None]:
        """D-worker d plans a decode-only step at `batch`: (pace, carry). Every step of the
        segment it starts takes `pace` times its cost; `carry` not None: plan one step only,
        `carry` seconds longer (work this overlay put on that step)."""
        return 1.0, None

    def step_ended(self, d: int) -> None:
        """D-worker d's step (or segment) ended."""

    def idle(self, d: int) -> None:
        """D-worker d has nothing to run: work charged to its next step is dropped."""
