"""`splitserve sim validate`'s run (`Validation`): measure a deployment (or read an earlier
validation JSON), simulate the same stream on the profile, and print and write the comparison.

Where the measurements come from, in order: `--real-json` (an earlier validation JSON and the
`.runs.json` beside it; nothing is measured), `--url` (a running deployment), a deployment this
command launches (disagg, or more than one worker; `--calibrate` measures its split costs
first), or one local plain worker (`--reprofile` profiles it first). With its own profiling,
every repeat runs between two canaries, and drift is read against `reference`: the canary
simulated on the profile the points are simulated on (`drift.modelled_reference`).

`--prefix-caching` (`validate_cache`): the engines keep their prefix caches, every repeat runs a
fresh seed's stream and is simulated on its own, between canaries drawn at fresh seeds too
(`Canary.reseeded`), read against the canary simulated on the given profile; no profiling or
calibration in the same command (that profile is the one validated).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from splitserve.bench.workload import WorkloadSpec
from splitserve.sim.calibration.drift import Canary, Speed, StretchPlan, modelled_reference
from splitserve.sim.cli_args import model_path
from splitserve.sim.deployment import SimConfig
from splitserve.sim.model import Profile, save_profile
from splitserve.sim.validate import (
    attach_records,
    compare,
    drift_json,
    launched,
    local_worker,
    measure_point,
    print_drifts,
    print_handovers,
    print_points,
    repeat_drifts,
    stored_real,
)
from splitserve.sim.validate_cache import (
    attach_seeds,
    compare_cached,
    measure_cached,
    seeds_json,
)

Real = dict[float, list[dict[str, Any]]]  # rate → the measured repeats' result dicts


class Validation:
    """One `sim validate` command on `prof`, `spec` and `cfg` (the command's `--profile`,
    workload and deployment options). `reference` is set exactly when the repeats run with
    canaries (this command profiled, calibrated or validates prefix caches, or a stored JSON
    carries canaries);
    `around` holds the canaries measured around that profiling. ValueError for options that
    do not go together (`--prefix-caching` with `--reprofile` or `--calibrate`; another
    connector without `--url` or `--real-json`)."""

    def __init__(self, args: argparse.Namespace, prof: Profile, spec: WorkloadSpec,
                 cfg: SimConfig, block_tokens: int = 128) -> None:
        self.args, self.prof, self.spec, self.cfg = args, prof, spec, cfg
        self.caching = bool(getattr(args, "prefix_caching", False))
        self.block_tokens = block_tokens  # the engines' cache block (prefix identity)
        if self.caching and (args.reprofile or args.calibrate):
            raise ValueError("--prefix-caching measures with the caches on; profile or "
                             "calibrate in a command without it, and pass that --profile")
        if cfg.connector != "splitserve" and not (args.url or args.real_json):
            raise ValueError("it launches deployments on splitserve's connector only; "
                             f"for {cfg.connector}, give --url of a running one")
        launches = not (args.url or args.real_json)
        if launches and self.on_a_deployment and args.reprofile:
            raise ValueError("--reprofile works with one plain worker (--mode chunked "
                             "--workers 1); profile a worker of the deployment instead")
        # the local worker's model, resolved before anything starts
        self.model_dir = (model_path(args.model_dir) if launches and not self.on_a_deployment
                          else None)
        if args.repeats < 3:
            print("note: fewer than 3 repeats per point; the spread is poorly known")
        self.rates: tuple[float, ...] = args.rates or (self.spec.arrival.rate,)
        self.reference: Speed | None = None  # the canary as the profile predicts it
        self.around: Speed | None = None  # the canaries measured around this profiling
        # a disaggregated deployment's canary reads D's P-busy stretch too, against the base
        # profile's decode shape (the same for the reference and every repeat)
        self.canary = (Canary(stretch=StretchPlan(), decode=prof.decode)
                       if cfg.mode == "disagg" else Canary())

    @property
    def on_a_deployment(self) -> bool:
        """What it launches without --url: a deployment (else one plain worker)."""
        return self.cfg.mode == "disagg" or self.cfg.n_workers != 1

    def run(self) -> int:
        args = self.args
        if args.real_json:
            real = self.stored(Path(args.real_json))
        elif args.url:
            real = self.measure(args.url)
        elif self.on_a_deployment:
            real = self.on_deployment()
        else:
            real = self.on_local_worker()
        self.report(real)
        return 0

    def pin_client(self) -> None:
        """This process (the benchmark client) onto --client-cpus, once the deployment is up:
        the launcher plans its cores from this process's affinity."""
        if self.args.client_cpus:
            os.sched_setaffinity(0, self.args.client_cpus)

    def measure(self, url: str) -> Real:
        """Every rate's repeats on `url`: with canaries when there is a reference, and always
        with `--prefix-caching` (each canary at a fresh seed; the reference is then the canary
        simulated on the given profile)."""
        self.pin_client()
        if self.caching:
            self.refer(self.prof)
            return measure_cached(url, self.spec, self.rates, self.args.repeats,
                                  canary=self.canary)
        run = self.canary if self.reference is not None else None
        return {r: measure_point(url, self.spec.with_rate(r), self.args.repeats, run)
                for r in self.rates}

    def refer(self, profile: Profile) -> None:
        """The reference: the canary simulated on the profile the points are simulated on."""
        self.reference = modelled_reference(profile, self.cfg, self.canary)
        for name, sp in (("simulated on the profile", self.reference),
                         ("measured around it", self.around)):
            if sp is not None:
                stretch = "" if sp.stretch is None else f", P-busy stretch {sp.stretch:.3f}"
                print(f"canary {name}: TTFT {sp.ttft_s * 1e3:.1f} ms, decode gap "
                      f"{sp.gap_s * 1e3:.2f} ms{stretch}")

    def profiled(self, url: str, take: Callable[[], Profile]) -> Profile:
        """Run `take` (the profiling) between two canaries (kept for the record: `around`),
        make its profile the one simulated, and refer to it."""
        self.pin_client()
        before = self.canary.run(url)
        self.prof = take()
        self.around = Speed.mean([before, self.canary.run(url)])
        self.refer(self.prof)
        if self.args.out:
            save_profile(self.prof, Path(self.args.out).with_suffix(".profile.json"))
        return self.prof

    def stored(self, path: Path) -> Real:
        """An earlier validation JSON's stream and repeats (and the per-request records of the
        `.runs.json` beside it, for the stretch and handover lines)."""
        stored = json.loads(path.read_text())
        self.spec, real, self.around = stored_real(stored)
        if stored.get("seeds"):  # a prefix-cache validation: each repeat its own stream
            self.caching = True
            attach_seeds(real, stored["seeds"])
        if stored.get("drift"):  # the canaries ran: drift against this profile's canary
            self.refer(self.prof)
        runs_json = path.with_suffix(".runs.json")
        if runs_json.exists():
            attach_records(real, json.loads(runs_json.read_text()))
        self.rates = tuple(sorted(real))
        return real

    def on_deployment(self) -> Real:
        """Launch splitserve's deployment of `cfg` and measure it (`--calibrate`: its split
        costs first)."""
        args, cfg, prof = self.args, self.cfg, self.prof
        with launched(cfg, args.cpus, cfg.token_budget or prof.token_budget,
                      router_cpus=args.router_cpus, prefix_caching=self.caching) as url:
            if args.calibrate and cfg.mode == "disagg":  # this deployment's split costs
                from splitserve.sim.calibration.calibrate import SplitPlan, calibrate_split

                split = self.profiled(url, lambda: calibrate_split(url, prof, SplitPlan(), cfg))
                print(f"split costs: {split.split.__dict__ | {'fit': '...'}}")
            return self.measure(url)

    def on_local_worker(self) -> Real:
        """Start one plain local worker and measure it (`--reprofile`: profile it first)."""
        from splitserve.demo_model import embedded_model_dir

        args, budget = self.args, self.cfg.token_budget or self.prof.token_budget
        model = self.model_dir or str(embedded_model_dir())
        with local_worker(model, args.cpus, budget, prefix_caching=self.caching) as url:
            if args.reprofile:  # calibrate on this very worker, under today's conditions
                from splitserve.sim.profile import ProfilePlan, profile_worker

                plan = ProfilePlan(prefill_lens=(16, 64, 256, 512, 1024, 2048),
                                   decode_prompt_lens=(32, 512), token_budget=budget)
                self.profiled(url, lambda: profile_worker(url, plan, model, probe_tcp=False))
            return self.measure(url)

    def report(self, real: Real) -> None:
        """Simulate every rate, print the comparison, and write `--out` (and, for a measured
        run, the raw repeats beside it for a later `--real-json`)."""
        args, cfg, prof = self.args, self.cfg, self.prof
        decode = ((prof.split.decode if prof.split else prof.decode) if cfg.mode == "disagg"
                  else None)
        # P's busy windows are one P's (read against D's step); a prefix-cache validation's
        # handovers would be read off one stream
        print_drifts(real, self.reference, None if self.caching else decode)
        if self.caching:
            lag = None if args.index_lag_ms is None else args.index_lag_ms / 1000
            points = compare_cached(prof, cfg, self.spec, self.rates, real, self.block_tokens,
                                    lag, self.reference)
            measured = [run.get("index_lag_s") for runs in real.values() for run in runs]
            print("router index lag simulated: " + (
                f"{args.index_lag_ms:g} ms (--index-lag-ms)" if lag is not None else
                "each repeat's measured mean, ms: " + ", ".join(
                    "none" if m is None else f"{m * 1000:.1f}" for m in measured)))
        else:
            if cfg.mode == "disagg":
                print_handovers(prof, cfg, self.spec, real)
            points = compare(prof, cfg, self.spec, self.rates, real, self.reference)
        paced = self.caching and not all(
            repeat_drifts(runs, self.reference) for runs in real.values())
        print_points(points, "every repeat simulated on the profile paced to the measured ITL "
                     "p50" if paced else "each repeat simulated at its canary's drift")
        if args.out and not args.real_json:
            raw = Path(args.out).with_suffix(".runs.json")
            raw.write_text(json.dumps({f"{r:g}": runs for r, runs in real.items()}, default=str))
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"profile": str(args.profile), "config": cfg.__dict__,
                 "workload": self.spec.to_dict(), "repeats": args.repeats,
                 "points": [p.to_dict() for p in points],
                 "drift": drift_json(self.reference, real, self.around),
                 "seeds": seeds_json(real) if self.caching else None}, indent=2))
            print(f"wrote {args.out}")
