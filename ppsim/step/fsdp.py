"""FSDP's exposed collectives in a pipeline's simulated step, as torchtitan 0.3.0 issues them under PP (FSDP2,
``reshard_after_forward`` False, gradient sync only after a stage's last backward). One step-time model for
``simulate --torchtitan-config``, ``plan`` and ``run``'s prediction (:func:`fsdp_step`).

Where torch 2.13's pipelining runtime issues them:

- **All-gather.** torchtitan ``fully_shard``s each transformer block, the embedding, and the final norm with the
  head (one unit each). GPipe and 1F1B (``PipelineScheduleSingle``) gather each unit inside the stage's first
  forward, after its input arrived: the time is added to that F. The other schedules (``_PipelineScheduleRuntime``)
  lower the order with ``UNSHARD`` actions issued asynchronously at the step's start; the rank's first forward waits
  for its stage's gathers (an ``UNSHARD`` action before it, in the timeline), while the gathers of the rank's other
  stages finish during that compute and are not exposed.
- **Reduce-scatter.** ``perform_reduce_grad`` runs each unit's post-backward after the stage's last B (or W of a
  split backward), after that action's send was posted: a ``REDUCE_GRAD`` action right after it, which delays the
  rank's next action but not the gradient it sent.

Each unit is one collective, costed from the profile's measured samples for that op and group size (interpolated
over sizes, :class:`CollectiveCosts`); without them, as a ring over the profile's point-to-point alpha/beta, which the
notes say. This module imports no torch."""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppsim.ir import Action, ActionType, Schedule
from ppsim.result import CollectiveTotals, CommSpan

INLINE_GATHER = ("gpipe", "1f1b")
"""torch's single-stage schedules (``PipelineScheduleSingle``): the gathers run inside the first forward."""
OPS = ("all_gather", "reduce_scatter")


def ring_seconds(num_bytes: int, *, dp: int, alpha_s: float, bytes_per_s: float) -> float:
    """One ring all-gather or reduce-scatter of ``num_bytes`` (the unsharded size) over ``dp`` ranks."""
    if dp <= 1 or num_bytes <= 0:
        return 0.0
    return (dp - 1) * (alpha_s + num_bytes / dp / bytes_per_s)


@dataclass(frozen=True)
class MeasuredCollective:
    """One op's measured seconds per full-tensor size on a group of ``group_size`` ranks (a profile's
    ``collectives[]``): sorted ``(bytes, median seconds)`` points and the fit's bandwidth to extrapolate."""

    op: str
    group_size: int
    points: tuple[tuple[int, float], ...]
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        """Linear between the measured sizes; below the smallest, its time (latency-bound); above the largest, its
        time plus the rest at the fit's bandwidth."""
        sizes = [b for b, _ in self.points]
        if num_bytes <= sizes[0]:
            return self.points[0][1]
        if num_bytes >= sizes[-1]:
            return self.points[-1][1] + (num_bytes - sizes[-1]) / self.bytes_per_s
        i = bisect.bisect_right(sizes, num_bytes)
        (b0, t0), (b1, t1) = self.points[i - 1], self.points[i]
        return t0 + (t1 - t0) * (num_bytes - b0) / (b1 - b0)


@dataclass(frozen=True)
class CollectiveCosts:
    """How FSDP's collectives are costed: the profile's measured all-gather / reduce-scatter (by op and group size),
    else rings over its point-to-point alpha/beta."""

    measured: tuple[MeasuredCollective, ...] = ()
    p2p_alpha_s: float | None = None
    p2p_bytes_per_s: float | None = None

    @classmethod
    def from_profile(cls, profile: Any) -> CollectiveCosts:
        """From a :class:`ppsim.profile.Profile` (its ``collectives`` and ``p2p``)."""
        measured = tuple(
            MeasuredCollective(op=c.op, group_size=c.group_size, bytes_per_s=c.beta_bytes_per_s,
                               points=tuple(sorted((s.bytes, s.median_s) for s in c.samples)))
            for c in profile.collectives if c.samples and c.beta_bytes_per_s > 0)
        p2p = profile.p2p
        return cls(measured=measured, p2p_alpha_s=None if p2p is None else p2p.alpha_s,
                   p2p_bytes_per_s=None if p2p is None else p2p.beta_bytes_per_s)

    def _nearest(self, op: str, group_size: int) -> MeasuredCollective | None:
        mine = [m for m in self.measured if m.op == op]
        return min(mine, key=lambda m: (abs(m.group_size - group_size), -m.group_size), default=None)

    @property
    def available(self) -> bool:
        return bool(self.measured) or (self.p2p_alpha_s is not None and bool(self.p2p_bytes_per_s))

    def seconds(self, op: str, num_bytes: int, *, group_size: int) -> float:
        """One ``op`` of a ``num_bytes`` full tensor over ``group_size`` ranks. Measured on a group of ``g`` ranks,
        a ring's step is ``t_g(m * g) / (g - 1)`` for ``m`` bytes a rank, so ``t(n) = (dp - 1) / (g - 1) *
        t_g(n * g / dp)``."""
        if group_size <= 1 or num_bytes <= 0:
            return 0.0
        fit = self._nearest(op, group_size)
        if fit is not None:
            g = fit.group_size
            return (group_size - 1) / (g - 1) * fit.seconds(num_bytes * g / group_size)
        if self.p2p_alpha_s is None or not self.p2p_bytes_per_s:
            raise ValueError("no collective costs: check `available` first")
        return ring_seconds(num_bytes, dp=group_size, alpha_s=self.p2p_alpha_s, bytes_per_s=self.p2p_bytes_per_s)

    def describe(self, group_size: int) -> str:
        """Where the costs come from, for the notes (stderr)."""
        parts = []
        for op in OPS:
            fit = self._nearest(op, group_size)
            if fit is None:
                parts.append(f"{op.replace('_', '-')}: the profile measured none, so a ring over its p2p alpha/beta "
                             "(re-run `ppsim calibrate` with p2p to measure it)")
            else:
                sizes = f"{fit.points[0][0] / 2**10:.0f} KiB-{fit.points[-1][0] / 2**20:.1f} MiB"
                scaled = "" if fit.group_size == group_size else f", scaled as a ring to {group_size} ranks"
                parts.append(f"{op.replace('_', '-')} measured on {fit.group_size} ranks at {sizes}{scaled}")
        return "; ".join(parts)


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


def unit_groups(shapes: Any, unit: Sequence[str], *, dp_shard: int, efsdp: int | None) -> list[tuple[int, int]]:
    """One ``fully_shard`` unit's collectives as ``(elements, group size)``, one per mesh its parameters are sharded
    on (torchtitan's ``apply_fsdp_to_decoder``): the dense parameters on ``dp_shard``; under EP (``efsdp`` set) a MoE
    layer's routed experts (:attr:`ppsim.job.memory.BlockShapes.sparse`, EP-local) on the ``efsdp`` mesh, a
    collective of their own, none at ``efsdp`` 1 (each rank holds its experts whole); without EP on ``dp_shard``
    with the rest."""
    dense = sparse = 0
    for name in unit:
        block = shapes.blocks[name]
        mine = sum(math.prod(shape) for key, shape in block.tensors if key in block.sparse)
        sparse += mine if efsdp is not None else 0
        dense += block.numel - (mine if efsdp is not None else 0)
    out = [(dense, dp_shard)] if dense and dp_shard > 1 else []
    if sparse and efsdp is not None and efsdp > 1:
        out.append((sparse, efsdp))
    return out


def stage_collective_seconds(shapes: Any, stage_modules: Sequence[Sequence[str]], *, dp_shard: int,
                             costs: CollectiveCosts, efsdp: int | None = None) -> tuple[list[float], list[float]]:
    """Each stage's gathers (``param_dtype``) and reduce-scatters (``reduce_dtype``), one collective per unit and
    mesh (:func:`unit_groups`), in seconds. ``shapes``: a :class:`ppsim.job.memory.JobShapes` (one TP rank's
    blocks); ``efsdp``: the routed experts' FSDP degree under EP (``None``: no EP)."""
    from ppsim.job.memory import DTYPE_BYTES

    gather_b, reduce_b = DTYPE_BYTES[shapes.param_dtype], DTYPE_BYTES[shapes.reduce_dtype]
    gather: list[float] = []
    reduce: list[float] = []
    for modules in stage_modules:
        groups = [g for unit in fsdp_units(modules) for g in unit_groups(shapes, unit, dp_shard=dp_shard, efsdp=efsdp)]
        gather.append(sum(costs.seconds("all_gather", n * gather_b, group_size=k) for n, k in groups))
        reduce.append(sum(costs.seconds("reduce_scatter", n * reduce_b, group_size=k) for n, k in groups))
    return gather, reduce


@dataclass(frozen=True)
class FsdpStep:
    """The schedule to simulate (with ``UNSHARD`` / ``REDUCE_GRAD`` actions where they block) and the seconds
    added at (rank, position) of it (:func:`ppsim.simulator.simulate`'s ``extra_s``), with what was assumed."""

    schedule: Schedule
    extra_s: Mapping[tuple[int, int], float]
    notes: tuple[str, ...] = ()
    shared: tuple[int, int] | None = None
    """``(processes per PP rank, cores)`` when the ranks run as local processes sharing one host's cores
    (``ppsim run`` on CPU): the step is simulated with processor sharing (:func:`ppsim.sharing.shared_cores_step`)."""
    shared_scale: float = 1.0
    """With :attr:`shared`: the time-sharing slowdown beyond the fair share (the profile's ``runtime.shared_scale``,
    measured by calibration's FSDP probe; 1 where it measured none)."""
    collectives: Mapping[str, CollectiveTotals] = dataclasses.field(default_factory=dict)
    """By kind, the collectives this step model placed (count, time, the part in ``extra_s``): FSDP's
    ``all_gather`` / ``reduce_scatter``, EP's ``all_to_all`` (:func:`ppsim.ep.ep_step` adds its time to this step's
    ``extra_s``); the result carries them (:attr:`ppsim.result.SimResult.collectives`)."""
    comm_spans: Mapping[tuple[int, int], CommSpan] = dataclasses.field(default_factory=dict)
    """Per (rank, position): the collectives' time in that action, the part of it exposed (in ``extra_s``) and their
    kinds, for the figures' communication lane (:attr:`ppsim.result.SimResult.comm_spans`)."""

    def simulate(self, simulate_with: Any) -> Any:
        """The step: ``simulate_with(extra_s)`` (a :class:`~ppsim.result.SimResult`), with the cores shared when
        :attr:`shared` says so, and :attr:`collectives` on it."""
        if self.shared is None:
            result = simulate_with(self.extra_s)
        else:
            from ppsim.sharing import shared_cores_step

            per_rank, cores = self.shared
            result = shared_cores_step(self.schedule, simulate_with, per_rank=per_rank, cores=cores,
                                       extra_s=self.extra_s, scale=self.shared_scale)[0]
        if not self.collectives:
            return result
        return dataclasses.replace(result, collectives=dict(self.collectives), comm_spans=dict(self.comm_spans))


def lower(schedule: Schedule, *, gather_s: Sequence[float], reduce_s: Sequence[float]) -> FsdpStep:
    """Place stage ``s``'s gathers (``gather_s[s]``) and reduce-scatters (``reduce_s[s]``) where torch's runtime
    issues them (module docstring)."""
    inline = schedule.name.lower() in INLINE_GATHER and schedule.num_stages_per_rank == 1
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
    return FsdpStep(schedule=dataclasses.replace(schedule, actions=tuple(rows)), extra_s=extra)


def fsdp_step(schedule: Schedule, *, shapes: Any, stage_modules: Sequence[Sequence[str]], dp_shard: int,
              costs: CollectiveCosts | None, time_scale: float = 1.0, efsdp: int | None = None) -> FsdpStep:
    """The step-time model of a PP x FSDP job: ``schedule`` with FSDP's exposed collectives in it (``time_scale``:
    seconds per cost unit of the simulation; ``efsdp``: the routed experts' FSDP degree under EP, ``None`` without
    EP). At ``dp_shard`` 1, or without costs (said in the notes), the schedule unchanged."""
    if dp_shard <= 1:
        return FsdpStep(schedule=schedule, extra_s={})
    if costs is None or not costs.available:
        return FsdpStep(schedule=schedule, extra_s={}, notes=(
            f"FSDP collectives (dp_shard {dp_shard}) not in the step: the profile measured no all-gather / "
            "reduce-scatter and has no p2p alpha/beta; calibrate with p2p to include them",))
    gather, reduce = stage_collective_seconds(shapes, stage_modules, dp_shard=dp_shard, costs=costs, efsdp=efsdp)
    step = lower(schedule, gather_s=[g / time_scale for g in gather], reduce_s=[r / time_scale for r in reduce])
    units = sum(len(unit_groups(shapes, unit, dp_shard=dp_shard, efsdp=efsdp))
                for modules in stage_modules for unit in fsdp_units(modules))
    exposed_gather = sum(s for (rank, pos), s in step.extra_s.items()
                         if step.schedule.actions[rank][pos].type is not ActionType.REDUCE_GRAD)
    exposed_reduce = sum(step.extra_s.values()) - exposed_gather
    acts = step.schedule.actions
    spans = {(r, p): CommSpan(t, t, ("reduce_scatter" if acts[r][p].type is ActionType.REDUCE_GRAD else "all_gather",))
             for (r, p), t in step.extra_s.items()}
    step = dataclasses.replace(step, comm_spans=spans, collectives={
        # each unit gathered once and reduce-scattered once a step, per mesh
        "all_gather": CollectiveTotals(units, sum(gather) / time_scale, exposed_gather),
        "reduce_scatter": CollectiveTotals(units, sum(reduce) / time_scale, exposed_reduce)})
    how = ("inside each stage's first forward" if schedule.name.lower() in INLINE_GATHER
           and schedule.num_stages_per_rank == 1 else "before each rank's first forward (the other stages' gathers "
           "overlap it)")
    note = (f"FSDP (dp_shard {dp_shard}): all-gathers {how}, reduce-scatters after each stage's last backward, "
            f"{sum(gather) * 1e3:.2f} + {sum(reduce) * 1e3:.2f} ms over the stages; {costs.describe(dp_shard)}")
    return dataclasses.replace(step, notes=(note,))


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
