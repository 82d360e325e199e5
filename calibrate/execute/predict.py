"""The step a run predicts before it starts, from costs alone: the costs in seconds (:func:`prediction_costs`) and the
simulated step with FSDP's collectives and, on a CPU host, the processes sharing its cores (:func:`predict_step`).
Below :mod:`ppsim.calibrate.execute.run` and calibration's runtime model, which both use it; it imports no torch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppsim.costs import StageCosts
    from ppsim.result import SimResult


def prediction_costs(costs: StageCosts, time_scale: float) -> StageCosts:
    """The costs the prediction simulates, in seconds (a cost string's units times ``time_scale``)."""
    if time_scale == 1.0:
        return costs
    ops = {k: tuple(x * time_scale for x in getattr(costs, k)) for k in ("F", "B", "I", "W", "FB")}
    return dataclasses.replace(costs, **ops, comm=costs.comm * time_scale, dispatch_s=costs.dispatch_s, unit="s")


def predict_step(fsdp: Any, costs: StageCosts, time_scale: float, *, recompute: Any, per_rank: int,
                 shared: bool, cores: int | None = None) -> tuple[SimResult, StageCosts]:
    """The predicted step of ``fsdp.schedule`` (:func:`~ppsim.calibrate.execute.run.run_step`). ``shared``:
    local CPU processes, ``pp x
    per_rank`` of them (dp_shard x tp per PP rank, computing in lockstep); once they outnumber the cores, each
    computation is stretched by how many compute beside it (:func:`ppsim.step.sharing.shared_cores_step`: processor
    sharing over the simulated timeline; the profile's ``compute_scale`` was measured with at most as many
    processes as cores)."""
    from ppsim.simulator import simulate

    costs_s = fsdp.costs if fsdp.costs is not None else prediction_costs(costs, time_scale)  # hand-offs placed
    from ppsim.step.sharing import core_plan, host_cores

    cores = cores or host_cores()
    schedule = fsdp.schedule
    sharing = shared and schedule.num_ranks * per_rank > cores
    step = dataclasses.replace(fsdp, shared=(per_rank, cores) if sharing else None, shared_scale=costs.shared_scale)
    predicted = step.simulate(lambda extra: simulate(schedule, costs_s, recompute=recompute, extra_s=extra))
    if not sharing:
        return predicted, costs
    pinned = core_plan(schedule.num_ranks, per_rank, cores)
    how = "" if pinned is None else ", each copy of the pipeline (one FSDP/TP position) pinned to cores of its own"
    note = (f"{schedule.num_ranks * per_rank} local processes ({schedule.num_ranks} PP ranks x {per_rank}) share "
            f"{cores} CPU cores{how}: each computation is stretched by how many compute beside it on its cores "
            "(processor sharing over the simulated step; the profile's compute_scale was measured with one process "
            "per PP rank); FSDP's exposed collectives share the cores too"
            + (f"; time-sharing slows the work {costs.shared_scale:.3g}x beyond the fair share (the profile's "
               "runtime.shared_scale, from calibration's FSDP probe)" if costs.shared_scale != 1.0 else
               "; the profile measured no time-sharing slowdown (runtime.shared_scale): the fair share alone"))
    return predicted, dataclasses.replace(costs, notes=(*costs.notes, note))
