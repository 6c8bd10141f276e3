"""A simulated run as the commands take it: the engine (`simulator.Simulation`) with the
overlay the profile and the deployment call for, composed here, not by the engine.

`overlay_for` is the one place that decides which calibration a run gets: a profile's split
costs (`calibration.overlay.SharedCoreOverlay`) on a disaggregated deployment over splitserve's
connector that applies them (`SimConfig.split_costs`), else the null overlay. The split costs
are measured through splitserve's connector (its push, its handover), so a `nixl` run gets
none. A caller that wants another overlay builds `Simulation(profile, config, workload,
overlay)` itself.
"""

from __future__ import annotations

from splitserve.sim.calibration.overlay import SharedCoreOverlay
from splitserve.sim.deployment import SimConfig, SimOutcome
from splitserve.sim.model import Profile
from splitserve.sim.overlay import Overlay
from splitserve.sim.simulator import Simulation
from splitserve.sim.workload import SimWorkload


def overlay_for(profile: Profile, config: SimConfig) -> Overlay:
    """The overlay a run of `profile` on `config` gets (see the module's docstring)."""
    if (config.mode != "disagg" or not config.split_costs or profile.split is None
            or config.connector != "splitserve"):
        return Overlay()
    return SharedCoreOverlay(profile.split, config.n_prefill, config.n_decode,
                             profile.max_num_seqs)


def simulate(profile: Profile, config: SimConfig, workload: SimWorkload,
             decode_profile: Profile | None = None) -> SimOutcome:
    """Run `workload` on the deployment `config` describes, with `overlay_for`'s overlay
    (`decode_profile`: D's workers, when not `profile`'s)."""
    return Simulation(profile, config, workload, overlay_for(profile, config),
                      decode_profile).run()
