"""The simulator's one seam for effects beyond the workers' own step costs: an `Overlay`.

The event loop (`simulator.Simulation`) models a cluster whose parts do not share hardware:
routers, P and D queues, continuous batching, a token budget, KV capacity and transfer links.
Anything else a deployment costs — e.g. router, client and workers sharing a few CPU cores
(`splitserve.sim.calibration.overlay.SharedCoreOverlay`) — enters only through the hooks below,
at fixed points of the loop. `Overlay()` itself is the null overlay: every hook leaves the
model as it is, so a simulation with it is the plain cluster model. The engine never picks an
overlay: whoever builds the run passes one in (`sim.run.simulate` composes a profile's).

Hooks come in two kinds:

- *build-time* hooks (`prefill_cost`, `decode_cost`, `gap_jitter_s`), always read;
- *per-request* hooks (`t1`, `join_ready`, `t1_emitted`) and *per-event* hooks on D-workers
  (`arrived` … `idle`), called only when `active` is True, so that the null overlay costs the
  hot loop nothing. D-workers are numbered 0..n_decode−1 and P-workers 0..n_prefill−1 in
  these hooks.

A hook gets values (a request's hand-off as a `Leg`, a worker's number, a batch size), never
indices into the run's arrays. An overlay reads and changes the run only through the
`RunControl` it is handed in `bind`, so the loop's invariants (one scheduled step per busy
worker, segments cut at step boundaries) hold.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from splitserve.sim.costmodel import Bins, DecodeCost, PrefillCost


class Leg(NamedTuple):
    """One request's hand-off from P to D, as the per-request hooks see it."""

    prompt_len: int
    output_len: int
    prefill: int  # its P-worker
    decode: int | None  # its D-worker; None: it has no decode leg (one output token)


class RunControl(Protocol):
    """What an overlay may read from and do to the run it is bound to (D-workers by number)."""

    def decode_batch(self, d: int) -> int:
        """The streams D-worker d runs now."""
        ...

    def decode_busy(self, d: int) -> bool:
        """D-worker d is running a step or a segment now."""
        ...

    def extend_decode_step(self, d: int, t: float, cost: float) -> None:
        """The step in progress at t on busy D-worker d takes `cost` seconds longer (a
        segment in progress is split at t first)."""
        ...

    def cut_decode_segment(self, d: int, t: float) -> None:
        """D-worker d's decode-only segment in progress (if any) ends at its next step
        boundary after t, so its next step is planned anew (through `decode_step`)."""
        ...

    def push_overlay_event(self, t: float, key: int) -> None:
        """Have the overlay's `overlay_event(key, t)` called at t (`key` is the overlay's)."""
        ...


class Overlay:
    """The null overlay; subclasses override the hooks they model."""

    #: True: the loop calls the per-event hooks; False: it never does
    active: bool = False
    #: the step-gap jitter the run's ITL carries instead of the profile's (None: the profile's)
    gap_jitter_s: Bins | None = None

    def bind(self, run: RunControl) -> None:
        """Called once before the run, with the run the hooks act on."""

    def prefill_cost(self, base: PrefillCost) -> PrefillCost:
        """A P-worker's prefill step cost, given the profile's."""
        return base

    def decode_cost(self, base: DecodeCost) -> DecodeCost:
        """A D-worker's decode step cost, given the profile's."""
        return base

    # per-request hooks: called only while `active` ----------------------------------------
    def t1(self, at: float, leg: Leg) -> float:
        """When the request's first token reaches the client, given `at` = the end of its last
        prefill step on P-worker `leg.prefill` plus the router hop. Must be >= `at`."""
        return at

    def join_ready(self, at: float, leg: Leg) -> float:
        """The earliest time the request's decode leg can join its D-worker, given `at` = t1
        plus the router hop (the KV's arrival bounds it separately). Must be >= `at`."""
        return at

    def t1_emitted(self, leg: Leg, t1: float) -> None:
        """The request's t1 is `t1` and its decode leg is on its way to D (`leg.decode`)."""

    # per-event hooks: called only while `active` ------------------------------------------
    def arrived(self, d: int, t: float) -> None:
        """A request assigned to D-worker d arrived at the router at t."""

    def overlay_event(self, key: int, t: float) -> None:
        """An event this overlay scheduled with `RunControl.push_overlay_event(t, key)` fired."""

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
