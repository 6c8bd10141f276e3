"""Discrete-event simulation of a splitserve deployment (router, P- and D-workers, KV links) or
of the colocated baselines (one engine doing both, with or without chunked prefill).

Workers step like vLLM's v1 scheduler: continuous batching, a token budget per step (decodes
first, one token each, then prompt chunks FIFO), KV capacity checked when a request is admitted
(its whole prompt + output is reserved; no preemption), at most `max_num_seqs` running
requests, requests arriving during a step join at the next step (`sim.stepping`). A step's
duration comes from the profile's cost model.

Speed: while a worker only decodes and nothing arrives, its steps are deterministic, so it
advances to the next finishing request in one event (a *segment*: step k lasts
`α + β·k` with α = a + b·context + c·batch, β = b·batch); an arrival cuts the segment at the next
step boundary (solved from the quadratic). Per-step work is never a Python loop over the batch:
finishing requests come off a heap keyed by the absolute step they finish on.

Disaggregated flow: the router picks P and D on arrival (per policy); P's last prefill step
emits t1 (TTFT), and the KV crosses its link (`handoff.KvLinks`): pushed while P prefills
(splitserve: D's first step emits t2) or pulled by D's next step once the leg reached it (NIXL:
that step replays t1, so t2..tN come one step later). P holds the KV until the transfer ends.

Effects beyond the workers' own step costs (e.g. router, client and workers sharing CPU cores)
enter only through the `Overlay` (`sim.overlay`) its caller passes in (`sim.run.simulate`
composes the profile's), whose hooks this loop calls at fixed points; with the null overlay
this is the plain cluster model.
"""

from __future__ import annotations

import heapq

import numpy as np

from splitserve.sim.deployment import Segment, SimConfig, SimOutcome, segment_arrays
from splitserve.sim.handoff import KvLinks
from splitserve.sim.model import Profile
from splitserve.sim.overlay import Leg, Overlay
from splitserve.sim.prefixcache import PrefixCaches
from splitserve.sim.routing import Route, SimRouter
from splitserve.sim.stepping import WorkerStepping
from splitserve.sim.workerstate import (
    COLOCATED,
    DECODE,
    KV_WAIT,
    PREFILL,
    STEP,
    Limits,
    Worker,
    next_boundary,
)
from splitserve.sim.workload import SimWorkload

# An event on the heap is a bare tuple (a NamedTuple made pushes and pops ~50 % slower):
# (time, seq: the push order, breaking ties; kind; subject; version). _EV_STEP: the worker
# whose step (or segment) ends, at its `version` then (a superseded step is skipped); _EV_JOIN:
# the request whose decode leg reaches its D; _EV_OVERLAY: the overlay's key
# (`RunControl.push_overlay_event`); _EV_LEG: the request whose pulled leg reaches D;
# _EV_REACH: the request that reaches the worker computing it whole (`_arrive`).
Event = tuple[float, int, int, int, int]
_EV_STEP, _EV_JOIN, _EV_OVERLAY, _EV_LEG, _EV_REACH = 0, 1, 2, 3, 4


class Simulation(WorkerStepping):
    """One run of one workload on one deployment, with the overlay its caller chose (default:
    the null one). `run()` returns a `SimOutcome`. Requests are indices into the run's
    arrays; P-workers are `W[0:len(P)]`, D-workers `W[len(P):]`. Its workers step as
    `WorkerStepping` says; it owns their events, the routing and the hand-offs. It is the
    `RunControl` its overlay is bound to.

    `decode_profile`: the D pool's workers, when they differ from P's (another TP degree, or
    other GPUs of the same model); D's steps, limits and KV memory are then its. None: every
    worker is `profile`'s."""

    def __init__(self, profile: Profile, config: SimConfig, workload: SimWorkload,
                 overlay: Overlay | None = None, decode_profile: Profile | None = None) -> None:
        self.profile, self.cfg, self.wl = profile, config, workload
        self.overlay = overlay if overlay is not None else Overlay()
        d_prof = decode_profile or profile
        if d_prof.model.kv_bytes_per_token != profile.model.kv_bytes_per_token:
            raise ValueError("P's and D's profiles must be of one model (their KV differs)")
        pf, dc, seqs = profile.prefill, profile.decode, profile.max_num_seqs
        jitter = self.overlay.gap_jitter_s
        self.jitter = profile.gap_jitter_s if jitter is None else jitter
        self.kvbpt, layers = profile.model.kv_bytes_per_token, profile.model.layers
        n = len(workload)
        self.arrivals = workload.arrivals.tolist()
        self.prompt_lens = workload.prompt_lens.tolist()
        self.output_lens = workload.output_lens.tolist()
        self.caches: PrefixCaches | None = None
        if workload.blocks is not None and config.prefix_caching:
            capacity = [profile.kv_capacity_tokens] * self.cfg.n_prefill + [
                d_prof.kv_capacity_tokens] * self.cfg.n_decode if config.mode == "disagg" else [
                profile.kv_capacity_tokens] * self.cfg.n_workers
            self.caches = PrefixCaches(workload.blocks, workload.block_tokens, self.prompt_lens,
                                       capacity, config.index_lag_s if config.cache_aware else 0)
        caches = self.caches
        self.links: KvLinks | None = None
        if config.mode == "disagg":
            self.links = KvLinks(profile.link(config.transport), config.n_prefill, layers,
                                 config.overlap, config.shared_link)
            p_pf = self.overlay.prefill_cost(pf)
            d_dc = self.overlay.decode_cost(d_prof.decode)
            npw = config.n_prefill
            self.P = [Worker(PREFILL, p_pf, dc, seqs, caches, i) for i in range(npw)]
            self.D = [Worker(DECODE, d_prof.prefill, d_dc, d_prof.max_num_seqs, caches, npw + i)
                      for i in range(config.n_decode)]
        else:
            self.P = [Worker(COLOCATED, pf, dc, seqs, caches, i)
                      for i in range(config.n_workers)]
            self.D = []
        self.W = self.P + self.D
        self.lim = ([self._limits(profile)] * len(self.P)  # each worker's limits
                    + [self._limits(d_prof)] * len(self.D))
        self.gpus = [profile.gpus] * len(self.P) + [d_prof.gpus] * len(self.D)  # by worker
        self.npw = len(self.P)
        # nixl, mooncake: D loads the prompt's blocks and its first step replays t1
        self.replay = config.mode == "disagg" and config.connector in ("nixl", "mooncake")
        self.pull = self.replay and config.connector == "nixl"  # D's step posts the READ
        self.charged = [0] * n  # per request: the prompt tokens it queued on its P (`load`)
        self.d_reused = [0] * n  # per request: the prompt tokens its D already held (delta)
        self.local = [False] * n  # per request: run whole on its D (prefill on D)
        self.kv_bytes = [0] * n  # per request: the KV bytes that crossed to D
        nan = float("nan")
        self.t1, self.t2, self.finish = [nan] * n, [nan] * n, [nan] * n
        self.prefill_start, self.prefill_end = [nan] * n, [nan] * n  # P's prefill of it
        # per request: the transfer's span (first bytes moving, or the READ posted, until the
        # KV is all at D) and its exposed tail (P's prefill end until then)
        self.kv_transfer, self.kv_tail = [nan] * n, [nan] * n
        self.failed = [False] * n
        self.decode_of, self.prefill_of = [-1] * n, [0] * n
        self.heap: list[Event] = []
        self.seq = 0
        self.segs: list[Segment] = []
        self.decode_worker, self.join_step = [-1] * n, [0] * n
        self.rng = np.random.default_rng(config.seed)
        self.overlay.bind(self)

    def _limits(self, profile: Profile) -> Limits:
        cfg = self.cfg
        return Limits(cfg.token_budget or profile.token_budget, profile.max_num_seqs,
                      profile.kv_capacity_tokens, cfg.mode != "colocated")

    # the event heap ----------------------------------------------------------------------
    def _push(self, t: float, kind: int, subject: int, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, subject, version))

    def _schedule(self, wi: int, w: Worker, end: float) -> None:
        w.version += 1
        w.busy = True
        self._push(end, _EV_STEP, wi, w.version)

    # the overlay's RunControl (D-workers by number) ----------------------------------------
    def decode_batch(self, d: int) -> int:
        return self.D[d].batch

    def decode_busy(self, d: int) -> bool:
        return self.D[d].busy

    def push_overlay_event(self, t: float, key: int) -> None:
        self._push(t, _EV_OVERLAY, key, 0)

    def extend_decode_step(self, d: int, t: float, cost: float) -> None:
        """The step in progress on busy D-worker d at t takes `cost` seconds longer. A segment
        is split: its steps done by t stay a segment (recorded now), the one in progress
        becomes a step."""
        wi, w = self.npw + d, self.D[d]
        if (record := w.split_segment(t, wi)) is not None:
            self.segs.append(record)
        w.step_dur += cost
        for r in w.joined:  # t2 comes with this step's end
            self.t2[r] += cost
        self._schedule(wi, w, w.started + w.step_dur)

    def cut_decode_segment(self, d: int, t: float) -> None:
        self.cut_segment(self.npw + d, self.D[d], t)

    # the KV hand-off from P to D ---------------------------------------------------------
    def _prefilled(self, wi: int, w: Worker, r: int, t: float) -> None:
        """P-worker wi finished request r's prompt at t: emit t1, then (splitserve) push the
        KV, the leg joining D at max(t1 + hop and the overlay's handover, the KV's arrival),
        or (NIXL) send the leg to D's scheduler, whose next step pulls it (`_post_read`), or
        (Mooncake: D's leg is there already) send the whole blocks, joining D on their arrival
        but not before t1 (the router relays the stream in order: D's tokens follow t1).
        Records the transfer's span (push: from its first bytes moving on the link; Mooncake:
        from P's send at t) and its tail (from t) when its arrival is known (NIXL: the READ's)."""
        hop, links, out = self.cfg.router_hop_s, self.links, self.output_lens[r]
        assert links is not None, "a hand-off happens only in a disaggregated run"
        leg = None  # the request as the overlay's per-request hooks see it
        if self.overlay.active:
            leg = Leg(self.prompt_lens[r], out, wi, self.decode_of[r] if out > 1 else None)
        t1 = self.overlay.t1(t + hop, leg) if leg is not None else t + hop
        self.t1[r] = t1
        w.load -= self.charged[r]
        if w.caches is not None:
            w.caches.store(wi, r)
        if out == 1:
            self.finish[r] = t1
            w.kv_used -= self.prompt_lens[r]
            if w.caches is not None:
                w.caches.release(wi, r)
            return
        ready = t1 + hop
        if leg is not None:
            self.overlay.t1_emitted(leg, t1)
            ready = self.overlay.join_ready(ready, leg)
        self.prefill_end[r] = t
        if self.pull:  # the READ waits for D's leg: `_post_read`
            self.prefill_of[r] = wi
            self._push(ready + self.cfg.pull_request_s, _EV_LEG, r, 0)
            return
        self.kv_bytes[r] = nbytes = self.kvbpt * (self.prompt_lens[r] - self.d_reused[r])
        if self.replay:  # mooncake: D's leg has waited since P's; P sends its blocks now
            arrive, free = links.pull(wi, nbytes, t)
            start = t
            ready = t1
        else:
            start, arrive, free = links.push(wi, nbytes, self.prefill_start[r], t)
        heapq.heappush(w.kv_release, (free, self.prompt_lens[r], r))
        self.kv_transfer[r], self.kv_tail[r] = arrive - start, arrive - t
        self._push(max(arrive, ready), _EV_JOIN, r, 0)

    def _post_read(self, r: int, t: float) -> None:
        """Request r's pulled leg reached its D's scheduler at t: D's next step (now, if D is
        idle) posts the READ of P's blocks; P holds them until it ends (a P blocked on KV is
        woken then); the leg joins D when they are in. The transfer's span runs from the
        READ's post, its tail from P's prefill end."""
        d, pi, links = self.D[self.decode_of[r]], self.prefill_of[r], self.links
        assert links is not None, "a hand-off happens only in a disaggregated run"
        w = self.P[pi]
        post = next_boundary(d, t) if d.busy else t
        self.kv_bytes[r] = nbytes = self.kvbpt * (self.prompt_lens[r] - self.d_reused[r])
        arrive, free = links.pull(pi, nbytes, post)
        heapq.heappush(w.kv_release, (free, self.prompt_lens[r], r))
        if not w.busy and w.queue:
            w.kind = KV_WAIT
            self._schedule(pi, w, max(t, w.kv_release[0][0]))
        self.kv_transfer[r], self.kv_tail[r] = arrive - post, arrive - self.prefill_end[r]
        self._push(arrive, _EV_JOIN, r, 0)

    def run(self) -> SimOutcome:
        """Route every request on its arrival and run the events to the last one."""
        n = len(self.arrivals)
        D, W, npw = self.D, self.W, self.npw
        router = SimRouter(self.rng, self.cfg, self.P, D, self.prompt_lens, self.lim,
                           self.caches if self.cfg.cache_aware else None)
        heap, arrivals, output_lens = self.heap, self.arrivals, self.output_lens
        pop = heapq.heappop
        i, events = 0, 0
        inf = float("inf")
        # a lagging index needs each change's time (`PrefixCaches.now`)
        clock = self.caches if self.caches is not None and self.caches.lag_s else None
        while i < n or heap:
            ta = arrivals[i] if i < n else inf
            if heap and heap[0][0] < ta:
                t, _, kind, subject, version = pop(heap)
                events += 1
                if clock is not None:
                    clock.now = t
                if kind == _EV_STEP:
                    w = W[subject]
                    if version != w.version:
                        continue
                    if w.kind == KV_WAIT:
                        w.busy = False
                        w.kind = STEP
                        self._plan(subject, w, t)
                    else:
                        self._boundary(subject, w, t)
                elif kind == _EV_OVERLAY:
                    self.overlay.overlay_event(subject, t)
                elif kind == _EV_LEG:
                    self._post_read(subject, t)
                elif kind == _EV_REACH:
                    self._reach(subject, t)
                else:  # decode leg reaches D
                    di = self.decode_of[subject]
                    w = D[di]
                    w.waiting.append(subject)
                    self._poke(npw + di, w, t)
                continue
            r, i = i, i + 1
            events += 1
            if clock is not None:
                clock.now = ta
            self._arrive(r, ta, router.route(r, bool(D) and output_lens[r] > 1))
        return self._outcome(events)

    def _arrive(self, r: int, t: float, route: Route) -> None:
        """Request r arrived at t and `route` is the router's choice: queue it there. A request
        one worker computes whole (colocated, or prefilled on its D) reaches it one router hop
        later (`_reach`), so its first token, like a split request's (`_prefilled`), comes one
        hop after it would on a zero-latency path; a split request queues on its P at once and
        pays the hop on t1."""
        hop = self.cfg.router_hop_s
        if route.d >= 0:
            self.decode_of[r] = route.d
            d = self.D[route.d]
            d.load += 1
            if route.local:
                self.local[r] = True
                if hop:
                    self._push(t + hop, _EV_REACH, r, 0)
                else:
                    self._reach(r, t)
                return
            self.d_reused[r] = route.d_reused
            if self.overlay.active:
                self.overlay.arrived(route.d, t)
        w = self.P[route.p]
        if self.D:
            w.queue.append(r)
            self.charged[r] = route.p_charged
            w.load += route.p_charged
            self._poke(route.p, w, t)
            return
        w.load += 1
        self.prefill_of[r] = route.p
        if hop:
            self._push(t + hop, _EV_REACH, r, 0)
        else:
            self._reach(r, t)

    def _reach(self, r: int, t: float) -> None:
        """Request r, computed whole by one worker (its D if `local`, else its colocated
        worker), reaches that worker at t: queue it there."""
        wi = self.npw + self.decode_of[r] if self.local[r] else self.prefill_of[r]
        w = self.W[wi]
        w.queue.append(r)
        self._poke(wi, w, t)

    def _outcome(self, events: int) -> SimOutcome:
        f = np.asarray
        return SimOutcome(
            arrivals=self.wl.arrivals, prompt_lens=self.wl.prompt_lens,
            output_lens=self.wl.output_lens, first_token=f(self.t1), second_token=f(self.t2),
            finish=f(self.finish), failed=f(self.failed, dtype=bool),
            **segment_arrays(self.segs), decode_worker=f(self.decode_worker),
            join_step=f(self.join_step), kv_transfer_s=f(self.kv_transfer),
            kv_tail_s=f(self.kv_tail), events=events,
            gap_jitter_s=self.jitter, prefill_busy_s=sum(w.prefill_s for w in self.W),
            prefill_gpu_s=sum(w.prefill_s * g for w, g in zip(self.W, self.gpus, strict=True)),
            **self._cache_arrays(),
        )

    def _cache_arrays(self) -> dict[str, np.ndarray]:
        """`SimOutcome`'s per-request cache fields (none without prefix caches)."""
        if self.caches is None:
            return {}
        return {"cached_tokens": np.asarray(self.caches.hits, dtype=np.int64),
                "local": np.asarray(self.local, dtype=bool),
                "kv_bytes": np.asarray(self.kv_bytes, dtype=np.int64)}

