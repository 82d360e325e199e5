"""FSDP's exposed collectives in a pipeline's simulated step, as torchtitan 0.3.0 issues them under PP (FSDP2,
``reshard_after_forward`` False, gradient sync only after a stage's last backward). The FSDP pass of the one step
model (:func:`ppsim.step.build.build_step`): ``simulate``, ``plan`` and ``run``'s prediction.

Where torch 2.13's pipelining runtime issues them:

- **All-gather.** torchtitan ``fully_shard``s each transformer block, the embedding, and the final norm with the
  head (one unit each). GPipe and 1F1B built by name (``PipelineScheduleSingle``) gather each unit inside the
  stage's first forward, after its input arrived: the time is added to that F. The other schedules, and any order
  run as an action list (``ppsim run``, :attr:`ppsim.step.job.StepJob.runtime_order`), run in
  ``_PipelineScheduleRuntime``, which lowers the order with ``UNSHARD`` actions issued asynchronously at the step's
  start; the rank's first forward waits for its stage's gathers (an ``UNSHARD`` action before it, in the timeline),
  while the gathers of the rank's other stages finish during that compute and are not exposed.
- **Reduce-scatter.** ``perform_reduce_grad`` runs each unit's post-backward after the stage's last B (or W of a
  split backward), after that action's send was posted: a ``REDUCE_GRAD`` action right after it, which delays the
  rank's next action but not the gradient it sent.

- **All-reduce (HSDP).** With ``dp_replicate`` above 1 each unit's reduce-scattered shard is then all-reduced over the
  replicas (FSDP2's ``HSDP``), in the same ``REDUCE_GRAD`` action.

Each unit is one collective per mesh, priced by :class:`ppsim.step.pricing.CollectiveCosts` on its group's placement
(the profile's measured samples, else the cluster's collective model, else a ring over the profile's p2p alpha/beta;
the notes say which). This module imports no torch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ppsim.ir import Action, ActionType, Schedule
from ppsim.result import CollectiveTotals, CommSpan
from ppsim.step.kinds import CollectiveKind
from ppsim.step.model import Step

if TYPE_CHECKING:
    from ppsim.step.job import StepJob
    from ppsim.step.sharing import NodeLinks

INLINE_GATHER = ("gpipe", "1f1b")
"""torch's single-stage schedules (``PipelineScheduleSingle``): the gathers run inside the first forward."""
AG, RS, AR = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE


def fsdp_units(modules: Sequence[str]) -> list[list[str]]:
    """A stage's ``fully_shard`` units (torchtitan's ``apply_fsdp_to_decoder``): each module alone, except the final
    ``norm`` and ``lm_head``, which are one unit."""
    units: list[list[str]] = []
    for name in modules:
        if name == "lm_head" and units and units[-1] == ["norm"]:
            units[-1].append(name)
        else:
            units.append([name])
    return units


def unit_groups(shapes: Any, unit: Sequence[str], *, dp_shard: int, efsdp: int | None) -> list[tuple[int, str]]:
    """One ``fully_shard`` unit's collectives as ``(elements, mesh)``, one per mesh its parameters are sharded on
    (torchtitan's ``apply_fsdp_to_decoder``): the dense parameters on ``"fsdp"`` (``dp_shard`` ranks); under EP
    (``efsdp`` set) a MoE layer's routed experts (:attr:`ppsim.job.memory.BlockShapes.sparse`, EP-local) on
    ``"efsdp"``, a collective of their own, none at ``efsdp`` 1 (each rank holds its experts whole); without EP on
    ``dp_shard`` with the rest."""
    dense = sparse = 0
    for name in unit:
        block = shapes.blocks[name]
        mine = sum(math.prod(shape) for key, shape in block.tensors if key in block.sparse)
        sparse += mine if efsdp is not None else 0
        dense += block.numel - (mine if efsdp is not None else 0)
    out = [(dense, "fsdp")] if dense and dp_shard > 1 else []
    if sparse and efsdp is not None and efsdp > 1:
        out.append((sparse, "efsdp"))
    return out


def stage_collective_seconds(job: StepJob) -> tuple[list[float], list[float], list[float]]:
    """Each stage's gathers (``param_dtype``) and reduce-scatters (``reduce_dtype``, then HSDP's all-reduce of the
    shard over the replicas), one collective per unit and mesh (:func:`unit_groups`), in seconds, each priced on its
    group's placement (:meth:`ppsim.step.build.StepJob.span`). ``job.shapes``: a
    :class:`ppsim.job.memory.JobShapes` (one TP rank's blocks)."""
    from ppsim.job.memory import DTYPE_BYTES

    shapes, costs = job.shapes, job.costs
    assert costs is not None
    gather_b, reduce_b = DTYPE_BYTES[shapes.param_dtype], DTYPE_BYTES[shapes.reduce_dtype]
    replicas = job.span("dp_replicate")
    gather: list[float] = []
    reduce: list[float] = []
    allreduce: list[float] = []
    for modules in job.stage_modules:
        g = r = a = 0.0
        for unit in fsdp_units(modules):
            for n, mesh in unit_groups(shapes, unit, dp_shard=job.degrees.fsdp, efsdp=job.degrees.efsdp):
                span = job.span(mesh)
                g += costs.seconds(AG, n * gather_b, group_size=span.ranks, nodes=span.nodes)
                r += costs.seconds(RS, n * reduce_b, group_size=span.ranks, nodes=span.nodes)
                if replicas.ranks > 1:  # HSDP: the shard all-reduced over the replicas
                    a += costs.seconds(AR, n * reduce_b // max(span.ranks, 1), group_size=replicas.ranks,
                                       nodes=replicas.nodes)
        gather.append(g)
        reduce.append(r)
        allreduce.append(a)
    return gather, reduce, allreduce


def gathers_inline(schedule: Schedule, *, runtime_order: bool = False) -> bool:
    """Whether torch gathers each FSDP unit inside the stage's first forward (a single-stage schedule torchtitan
    builds by name), rather than at the step's start (module docstring)."""
    return not runtime_order and schedule.name.lower() in INLINE_GATHER and schedule.num_stages_per_rank == 1


def lower(schedule: Schedule, *, gather_s: Sequence[float], reduce_s: Sequence[float],
          runtime_order: bool = False) -> Step:
    """Place stage ``s``'s gathers (``gather_s[s]``) and reduce-scatters (``reduce_s[s]``) where torch's runtime
    issues them (module docstring; ``runtime_order``: :attr:`ppsim.step.job.StepJob.runtime_order`)."""
    inline = gathers_inline(schedule, runtime_order=runtime_order)
    rows: list[tuple[Action, ...]] = []
    extra: dict[tuple[int, int], float] = {}
    for rank, row in enumerate(schedule.actions):
        first_f: dict[int, int] = {}
        last_b: dict[int, int] = {}
        for pos, action in enumerate(row):
            for comp in action.computations:
                if comp.type is ActionType.F:
                    first_f.setdefault(comp.stage, pos)
                elif comp.type in (ActionType.B, ActionType.W):
                    last_b[comp.stage] = pos
        out: list[Action] = []
        if not inline and first_f:
            stage = min(first_f, key=first_f.__getitem__)  # the rank's first forward waits for its gathers
            extra[(rank, 0)] = gather_s[stage]
            out.append(Action(stage, ActionType.UNSHARD))
        for pos, action in enumerate(row):
            if inline and any(first_f.get(c.stage) == pos for c in action.computations if c.type is ActionType.F):
                extra[(rank, len(out))] = sum(gather_s[s] for s, p in first_f.items() if p == pos)
            out.append(action)
            for stage in sorted(s for s, p in last_b.items() if p == pos):
                extra[(rank, len(out))] = reduce_s[stage]
                out.append(Action(stage, ActionType.REDUCE_GRAD))
        rows.append(tuple(out))
    return Step(schedule=dataclasses.replace(schedule, actions=tuple(rows)), extra_s=extra)


def fsdp_pass(step: Step, job: StepJob) -> Step:
    """``step`` with FSDP's exposed collectives lowered into it (``job.time_scale``: seconds per cost unit of the
    simulation). At ``dp_shard`` 1, or without any price (said in the notes), ``step`` unchanged."""
    dp_shard = job.degrees.fsdp  # the dense parameters' mesh: dp_shard x cp
    if dp_shard <= 1:
        return step
    costs = job.costs
    if costs is None or not costs.available:
        if job.placement is not None:  # --cluster given: its prices are seconds, the step's unit costs are not
            return step.plus(note=(
                f"FSDP collectives (dp_shard {dp_shard}) not in the step: --cluster prices them in seconds and the "
                "step is in unit costs (no --profile); give --profile (`ppsim calibrate`) to include them"))
        return step.plus(note=(
            f"FSDP collectives (dp_shard {dp_shard}) not in the step: the profile measured no all-gather / "
            "reduce-scatter and has no p2p alpha/beta, and no --cluster was given; calibrate with p2p or give "
            "--cluster to include them"))
    gather, reduce, allreduce = stage_collective_seconds(job)
    scale = job.time_scale
    lowered = lower(step.schedule, gather_s=[g / scale for g in gather],
                    reduce_s=[(r + a) / scale for r, a in zip(reduce, allreduce)], runtime_order=job.runtime_order)
    acts = lowered.schedule.actions
    is_reduce = {(r, p): acts[r][p].type is ActionType.REDUCE_GRAD for (r, p) in lowered.extra_s}
    exposed_gather = sum(t for k, t in lowered.extra_s.items() if not is_reduce[k])
    exposed_after = sum(lowered.extra_s.values()) - exposed_gather  # reduce-scatters, then HSDP's all-reduces
    share = sum(reduce) / (sum(reduce) + sum(allreduce)) if sum(reduce) + sum(allreduce) > 0 else 1.0
    exposed_reduce = exposed_after * share
    meshes = [mesh for modules in job.stage_modules for unit in fsdp_units(modules)
              for _, mesh in unit_groups(job.shapes, unit, dp_shard=dp_shard, efsdp=job.degrees.efsdp)]
    gather_across = any(job.span(mesh).nodes > 1 for mesh in set(meshes))
    reduce_across = gather_across or job.span("dp_replicate").nodes > 1
    spans = {k: CommSpan(t, t, (RS.value,), reduce_across) if is_reduce[k] else CommSpan(t, t, (AG.value,),
                                                                                          gather_across)
             for k, t in lowered.extra_s.items()}
    placed = tuple(p for mesh in dict.fromkeys(meshes) for p in job.placed(mesh, meshes.count(mesh), AG))
    totals = {AG.value: CollectiveTotals(len(meshes), sum(gather) / scale, exposed_gather, placed),
              RS.value: CollectiveTotals(len(meshes), sum(reduce) / scale, exposed_reduce,
                                         tuple(q for p in placed for q in job.placed(p.group, p.count, RS)))}
    replicas = job.span("dp_replicate")
    if replicas.ranks > 1:
        totals[AR.value] = CollectiveTotals(len(meshes), sum(allreduce) / scale, exposed_after - exposed_reduce,
                                            job.placed("dp_replicate", len(meshes), AR))
    how = ("inside each stage's first forward" if gathers_inline(step.schedule, runtime_order=job.runtime_order)
           else "at the step's start, waited for by each rank's first forward (the other stages' gathers overlap "
           "it)")
    span = job.span("fsdp")
    hsdp = (f", each shard then all-reduced over {replicas.ranks} replicas (HSDP), {sum(allreduce) * 1e3:.2f} ms"
            if replicas.ranks > 1 else "")
    note = (f"FSDP (dp_shard {dp_shard}): all-gathers {how}, reduce-scatters after each stage's last backward{hsdp}, "
            f"{sum(gather) * 1e3:.2f} + {sum(reduce) * 1e3:.2f} ms over the stages; "
            f"{costs.describe(span.ranks, span.nodes)}")
    merged = dict(lowered.extra_s)
    for k, t in step.extra_s.items():  # an earlier pass's seconds keep their actions (FSDP runs first: none)
        merged[k] = merged.get(k, 0.0) + t
    links = node_links(job) if gather_across or reduce_across else None
    if links is not None:
        note += (f"; PP ranks share nodes of {links.nics} NIC(s): their collectives across nodes share them while "
                 "they run at once")
    return dataclasses.replace(step, schedule=lowered.schedule, extra_s=merged, comm_spans=spans,
                               notes=(*step.notes, note), collectives={**step.collectives, **totals}, links=links)


def node_links(job: StepJob) -> NodeLinks | None:
    """Where the job's PP ranks sit on nodes and the NICs a node has (:class:`ppsim.step.sharing.NodeLinks`), where
    some node carries more processes than NICs; ``None`` without a cluster or where no node does."""
    cluster = job.costs.cluster if job.costs is not None else None
    if job.placement is None or cluster is None:
        return None
    from ppsim.step.sharing import NodeLinks, contended

    links = NodeLinks(tuple(job.placement.pp_rank_nodes(j) for j in range(job.degrees.pp)), cluster.nics_per_node)
    return links if contended(links) else None


def original_positions(lowered: Schedule, original: Schedule) -> list[list[int]]:
    """Per rank, where each of ``original``'s actions sits in ``lowered`` (:func:`lower` only inserts actions)."""
    out: list[list[int]] = []
    for low, row in zip(lowered.actions, original.actions):
        where: list[int] = []
        j = 0
        for action in row:
            while low[j] is not action and low[j] != action:
                j += 1
            where.append(j)
            j += 1
        out.append(where)
    return out
