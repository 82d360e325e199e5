"""``build_step``: the one assembly of a training step from a pipeline order. ``simulate``, ``plan``, ``run``'s
prediction and calibration's FSDP probe all call it; each dimension's communication is one pass, applied in the
order torch's runtime lowers them:

1. FSDP (:func:`ppsim.step.fsdp.fsdp_pass`): ``UNSHARD`` gathers and ``REDUCE_GRAD`` reduce-scatters (and HSDP's
   all-reduce) on the ``fsdp`` / ``efsdp`` / ``dp_replicate`` groups;
2. EP (:func:`ppsim.step.ep.ep_pass`): dispatch and combine all-to-alls in the MoE stages' F and B/I on the ``ep``
   group, hidden under DualPipe's overlapped pairs;
3. PP (:func:`ppsim.step.pipeline_comm.pipeline_pass`): each hand-off priced on the link between its two ranks
   (within a node or across), in the costs the simulator replays;
4. the host's cores shared by local processes (``ppsim run`` on CPU, :mod:`ppsim.step.sharing`) at simulation.

TP's per-layer collectives stay inside the layers' measured costs (a profile at the job's TP degree) or the plan's
unit costs. Context parallelism's K/V all-gathers and their gradients' reduce-scatters are one more pass
(:func:`ppsim.step.cp.cp_pass`, after EP). Prices come from one place,
:class:`ppsim.step.pricing.CollectiveCosts`, on each group's placement (:mod:`ppsim.step.placement`). This module
imports no torch."""

from __future__ import annotations

from typing import Any

from ppsim.ir import Schedule
from ppsim.step.cp import cp_pass
from ppsim.step.ep import ep_pass
from ppsim.step.fsdp import fsdp_pass
from ppsim.step.job import StepJob
from ppsim.step.model import Step
from ppsim.step.pipeline_comm import pipeline_pass

__all__ = ["StepJob", "build_step"]


def build_step(schedule: Schedule, stage_costs: Any, job: StepJob | None) -> Step:
    """``schedule`` as a timed step: every pass's communication in it (module docstring). ``stage_costs``: the
    :class:`ppsim.costs.StageCosts` it is simulated with; ``job`` ``None``: the pipeline alone."""
    step = Step(schedule=schedule, extra_s={})
    if job is None:
        return step
    warning = None if job.costs is None else job.costs.mismatch()
    if warning is not None:
        step = step.plus(note=warning)
    step = fsdp_pass(step, job)
    step = ep_pass(step, stage_costs, job)
    step = cp_pass(step, stage_costs, job)
    step = pipeline_pass(step, stage_costs, job)
    if job.shared is not None:
        from dataclasses import replace

        step = replace(step, shared=job.shared, shared_scale=job.shared_scale)
    return step
