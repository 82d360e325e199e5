"""The step model's FSDP and EP passes called one at a time, as the older tests of each pass call them (the product
calls :func:`ppsim.step.build.build_step`, which runs every pass)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ppsim.ir import Schedule
from ppsim.job.degrees import Degrees
from ppsim.step.build import StepJob
from ppsim.step.ep import ep_pass
from ppsim.step.fsdp import fsdp_pass
from ppsim.step.model import Step
from ppsim.step.pricing import CollectiveCosts


def fsdp_step(schedule: Schedule, *, shapes: Any, stage_modules: Sequence[Sequence[str]], dp_shard: int,
              costs: CollectiveCosts | None, time_scale: float = 1.0, efsdp: int | None = None) -> Step:
    """The FSDP pass alone on one host (``efsdp``: the experts' FSDP degree under EP, ``None`` without EP)."""
    tp = getattr(shapes, "tp", 1) or 1
    ep = dp_shard * tp // efsdp if efsdp else 1
    job = StepJob(shapes=shapes, stage_modules=stage_modules, costs=costs, time_scale=time_scale,
                  degrees=Degrees(pp=schedule.num_ranks, tp=tp, dp_shard=dp_shard, ep=ep))
    return fsdp_pass(Step(schedule=schedule, extra_s={}), job)


def ep_step(step: Step, stage_costs: Any, *, shapes: Any, stage_modules: Sequence[Sequence[str]], ep: int,
            costs: CollectiveCosts | None, overlap: str = "dualpipe", in_blocks: bool = False) -> Step:
    """The EP pass alone on ``step``, its group of ``ep`` ranks within one host."""
    job = StepJob(shapes=shapes, stage_modules=stage_modules, costs=costs, ep_overlap=overlap, ep_in_blocks=in_blocks,
                  degrees=Degrees(pp=step.schedule.num_ranks, dp_shard=ep, ep=ep))
    return ep_pass(step, stage_costs, job)
