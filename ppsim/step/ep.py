"""Expert parallelism's all-to-alls in a pipeline's simulated step: the EP pass of the one step model
(:func:`ppsim.step.build.build_step`), after FSDP's (:mod:`ppsim.step.fsdp`), whose step it extends.

**What is issued.** With EP degree ``E > 1`` each MoE layer's forward sends its tokens to their experts' ranks
(*dispatch*) and brings the experts' outputs back (*combine*): two all-to-alls; its backward does the two again with
the gradients. One all-to-all of one microbatch moves each rank's buffer of ``tokens x top_k x dim`` elements in
``param_dtype`` (``tokens``: the microbatch's tokens / tp, as torchtitan shards the sequence before dispatching),
of which ``(E - 1) / E`` leaves the rank at balanced routing. So a stage holding ``L`` MoE layers issues ``2L``
all-to-alls in each F and ``2L`` in each B or I (the backward's input half carries them); W none.

**What one costs** (:func:`all_to_all_seconds`), in this order, the notes saying which:

1. the profile's measured ``all_to_all`` samples (its ``collectives``, by group size and nodes, interpolated over
   sizes and scaled to ``E`` ranks within a node as :class:`ppsim.step.pricing.CollectiveCosts` does for every op);
2. else the cluster's model (``--cluster``): grouped point-to-point bounded by the links within a node and by the
   node's NICs across nodes, on the EP group's placement (:mod:`ppsim.step.collectives`);
3. else the profile's p2p alpha/beta, as a pairwise exchange: ``(E - 1) * (alpha + bytes / E / beta)``;
4. else (unit costs, or a profile with neither) the stated default :data:`DEFAULT_COMM_RATIO`: a MoE layer's two
   forward all-to-alls take as long as its forward compute, DeepSeek-V3's "computation-to-communication ratio of
   approximately 1:1" for cross-node EP (technical report, section 3.2.1). A stage's compute in MoE layers is its
   F times the MoE layers' share of its layers (the head counted as one layer, the embedding as none).

**Where it is exposed** (:func:`exposed_seconds`).

* An eager (single) F, B or I of a stage holding MoE layers waits for its all-to-alls: their whole time is added to
  the action (``extra_s``, as FSDP's are). W issues none.
* An overlapped pair ``OVERLAP_F_B`` (DualPipe, DualPipeV) is DeepSeek's F&B chunk (report, figure 4): the forward's
  attention / MLP and the backward's run on the compute stream while the other direction's dispatch / combine run on
  the communication stream, so **one direction's all-to-alls hide only under the other direction's compute**, and
  only under compute in MoE layers (each all-to-all is paired with an attention or MLP segment of a MoE layer of the
  other chunk; the pair's head and tail, the embedding, dense layers and the head's compute, have no all-to-all of
  the other chunk beside them). Exposed::

      max(0, comm_F - overlappable_B) + max(0, comm_B - overlappable_F)
      overlappable_X = the pair's X-half compute x the MoE layers' share of X's stage

  which is ``max(0, comm_F + comm_B - overlappable compute)`` whenever neither direction's all-to-alls outlast the
  other's compute alone (both under it: nothing exposed; the figure's "both all-to-all and PP communication can be
  fully hidden"), and larger when one does (one direction cannot borrow the other's slack: its own compute waits
  for its own tokens). The pair's halves are the simulator's (``StageCosts.pair_split``).
* ``overlap="chunked"``: torchtitan's chunked EP overlap (``experiments/graph_trainer/ep_overlap_pass.py``: each
  MoE region cut into two chunks, both dispatches launched, then each chunk's experts run while the other chunk's
  exchange is in flight; forward chunk order 0 then 1, backward 1 then 0). For an eager F, B or I, per MoE layer of
  all-to-all time ``t`` (dispatch or combine) and expert compute ``e`` (half the layer's compute in that direction):
  the first chunk's dispatch and the last chunk's combine are exposed, the other two halves hide under the other
  chunk's experts: ``t + 2 * max(0, t/2 - e/2)`` instead of ``2t``. Overlapped pairs keep DeepSeek's rule.

The all-to-alls' count, total and exposed time go on the step (``Step.collectives["all_to_all"]``) and from
there on the result (``simulate --json``'s ``collectives``). Routing is taken as balanced (no hot experts), the
all-to-alls of different microbatches never contend, and a recomputed backward's extra forward is not counted as
overlappable. This module imports no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ppsim.ir import Action, ActionType, Schedule
from ppsim.result import CollectiveTotals, CommSpan
from ppsim.step.kinds import CollectiveKind
from ppsim.step.model import Step
from ppsim.step.pricing import CollectiveCosts

if TYPE_CHECKING:
    from ppsim.step.job import StepJob

A2A = CollectiveKind.ALL_TO_ALL

DEFAULT_COMM_RATIO = 1.0
"""Without measured costs: a MoE layer's forward all-to-alls (dispatch + combine) over its forward compute
(DeepSeek-V3 technical report, section 3.2.1: about 1:1 for cross-node EP). The backward's move the same bytes, so
they take the same time."""
OVERLAPS = ("dualpipe", "chunked", "sequential")
"""``dualpipe``: eager actions expose all their all-to-alls, overlapped pairs DeepSeek's rule (module docstring);
``chunked``: eager actions as torchtitan's two-chunk EP overlap, pairs as ``dualpipe``; ``sequential``: a runtime
that runs an overlapped pair's two halves one after the other (torch 2.13's ``_PipelineScheduleRuntime``, which
``ppsim run`` drives through torchtitan): every all-to-all exposed, the pairs' too."""


def all_to_all_bytes(shapes: Any) -> int:
    """One rank's buffer for one all-to-all of one microbatch in one MoE layer (``tokens x top_k x dim`` in
    ``param_dtype``); ``(E - 1) / E`` of it leaves the rank. ``shapes``: a :class:`ppsim.job.memory.JobShapes`."""
    from ppsim.job.memory import DTYPE_BYTES

    return shapes.moe_tokens * shapes.moe_top_k * shapes.dim * DTYPE_BYTES[shapes.param_dtype]


def all_to_all_seconds(num_bytes: int, *, ep: int, costs: CollectiveCosts | None, nodes: int = 1) -> float | None:
    """One all-to-all of ``num_bytes`` a rank over ``ep`` ranks on ``nodes`` nodes, priced by ``costs``; ``None``
    without any price (the caller uses :data:`DEFAULT_COMM_RATIO`)."""
    if costs is None or not costs.can_price(A2A):
        return None
    return costs.seconds(A2A, num_bytes, group_size=ep, nodes=nodes)


def describe(costs: CollectiveCosts | None, ep: int, nodes: int = 1) -> str:
    """Where one all-to-all's cost comes from, for the notes."""
    if costs is not None and costs.can_price(A2A):
        return costs.source(A2A, ep, nodes)
    return (f"no measured all-to-all or p2p alpha/beta, so the stated default: a MoE layer's forward all-to-alls take "
            f"{DEFAULT_COMM_RATIO:g}x its forward compute (DeepSeek-V3's ~1:1 for cross-node EP); calibrate with p2p "
            "for a measured cost")


def moe_share(modules: Sequence[str], moe_layers: frozenset[str]) -> tuple[int, float]:
    """A stage's MoE layers and their share of its compute: each layer weighs one, the head (``lm_head``) one, the
    embedding and the final norm none."""
    moe = sum(1 for m in modules if m in moe_layers)
    weight = sum(1 for m in modules if m.startswith("layers.") or m == "lm_head")
    return moe, moe / weight if weight else 0.0


@dataclass(frozen=True)
class StageComm:
    """One stage's all-to-alls per microbatch: ``layers`` MoE layers, each all-to-all ``each_s`` (in the step's cost
    unit), ``share`` of the stage's compute in MoE layers."""

    layers: int
    each_s: float
    share: float

    @property
    def per_direction(self) -> float:
        """The all-to-alls of one F, or of one B/I: a dispatch and a combine per MoE layer."""
        return 2 * self.layers * self.each_s


def _stage_modules(schedule: Schedule, stage_modules: Sequence[Sequence[str]], stage: int) -> Sequence[str]:
    """A stage's modules: by stage, or (a DualPipe's second chain, one list per chain position) by position."""
    return stage_modules[stage] if len(stage_modules) == schedule.num_stages else stage_modules[
        schedule.position(stage)]


def stage_comms(schedule: Schedule, stage_costs: Any, *, shapes: Any, stage_modules: Sequence[Sequence[str]],
                ep: int, costs: CollectiveCosts | None, nodes: int = 1, time_scale: float = 1.0) -> list[StageComm]:
    """Each stage's :class:`StageComm` (``stage_costs``: the schedule's :class:`ppsim.costs.StageCosts`; priced
    seconds are divided by ``time_scale``, the simulation's seconds per cost unit)."""
    moe_layers = frozenset(shapes.moe_layers)
    priced = all_to_all_seconds(all_to_all_bytes(shapes), ep=ep, costs=costs, nodes=nodes)
    measured = None if priced is None else priced / time_scale
    out = []
    for stage in range(schedule.num_stages):
        layers, share = moe_share(_stage_modules(schedule, stage_modules, stage), moe_layers)
        if not layers:
            out.append(StageComm(0, 0.0, share))
            continue
        if measured is not None:
            each = measured
        else:
            forward = stage_costs.op_cost(schedule, stage, ActionType.F) * stage_costs.compute_scale
            each = DEFAULT_COMM_RATIO * forward * share / layers / 2
        out.append(StageComm(layers, each, share))
    return out


def exposed_seconds(schedule: Schedule, stage_costs: Any, action: Action, comms: Sequence[StageComm],
                    overlap: str = "dualpipe") -> tuple[int, float, float]:
    """``(count, total, exposed)`` of one action's all-to-alls (module docstring's rule)."""
    if action.type is ActionType.OVERLAP_F_B:
        f, b = action.sub_actions
        cf = comms[f.stage]
        cb = comms[b.stage] if b.type in (ActionType.B, ActionType.I) else StageComm(0, 0.0, 0.0)
        if not cf.layers and not cb.layers:
            return 0, 0.0, 0.0
        if overlap == "sequential":
            total = cf.per_direction + cb.per_direction
            return 2 * (cf.layers + cb.layers), total, total
        duration, share = stage_costs.pair_split(schedule, f.stage, b.stage, b.type)
        duration *= stage_costs.compute_scale
        hide_under_f, hide_under_b = duration * share * cf.share, duration * (1 - share) * cb.share
        exposed = max(0.0, cf.per_direction - hide_under_b) + max(0.0, cb.per_direction - hide_under_f)
        return 2 * (cf.layers + cb.layers), cf.per_direction + cb.per_direction, exposed
    if action.type not in (ActionType.F, ActionType.B, ActionType.I):
        return 0, 0.0, 0.0
    c = comms[action.stage]
    if not c.layers:
        return 0, 0.0, 0.0
    total = c.per_direction
    if overlap != "chunked":
        return 2 * c.layers, total, total
    compute = stage_costs.op_cost(schedule, action.stage, action.type) * stage_costs.compute_scale
    experts = compute * c.share / c.layers / 2  # half of one MoE layer's compute in this direction
    t = c.each_s
    return 2 * c.layers, total, c.layers * (t + 2 * max(0.0, t / 2 - experts / 2))


def ep_pass(step: Step, stage_costs: Any, job: StepJob) -> Step:
    """``step`` (the schedule, FSDP's collectives in it or not: :mod:`ppsim.step.fsdp`) with EP's exposed
    all-to-alls added to its actions' ``extra_s`` and their totals in its ``collectives``. At ``ep`` 1 or for a
    dense model, ``step`` unchanged. ``stage_costs``: the :class:`ppsim.costs.StageCosts` the step is simulated
    with (the pairs' halves, and the default cost's compute)."""
    ep, shapes, overlap, in_blocks = job.degrees.ep, job.shapes, job.ep_overlap, job.ep_in_blocks
    assert overlap in OVERLAPS, overlap
    if ep <= 1 or not shapes.moe_layers:
        return step
    schedule = step.schedule
    span = job.span("ep")
    comms = stage_comms(schedule, stage_costs, shapes=shapes, stage_modules=job.stage_modules, ep=ep,
                        costs=job.costs, nodes=span.nodes, time_scale=job.time_scale)
    extra = dict(step.extra_s)
    spans = dict(step.comm_spans)
    count, total, exposed = 0, 0.0, 0.0
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            n, t, e = exposed_seconds(schedule, stage_costs, action, comms, overlap)
            if not n:
                continue
            count, total, exposed = count + n, total + t, exposed + e
            added = e - t if in_blocks else e
            if added:
                extra[(rank, pos)] = extra.get((rank, pos), 0.0) + added
            spans[(rank, pos)] = spans.get((rank, pos), CommSpan(0.0, 0.0)).plus(t, e, A2A.value, span.nodes > 1)
    unit = "s" if stage_costs.unit == "s" else " units"
    nbytes = all_to_all_bytes(shapes)
    how = ("overlapped F&B pairs run one half after the other in this runtime: every all-to-all waited for"
           if _has_pairs(schedule) and overlap == "sequential" else
           "overlapped F&B pairs hide one direction under the other" if _has_pairs(schedule)
           else "no overlapped F&B pairs: eager actions wait for them")
    where = f" over {span.nodes} nodes" if span.nodes > 1 else ""
    note = (f"EP (ep {ep}{where}): a dispatch and a combine all-to-all per MoE layer in each F and each B/I, "
            f"{nbytes * (ep - 1) // ep / 2**20:.2f} MiB leaving a rank per all-to-all per microbatch; {count} in the "
            f"step, {total:.4g}{unit} of which {exposed:.4g}{unit} exposed ({how}"
            f"{', eager ones chunked as torchtitan' if overlap == 'chunked' else ''}); "
            f"{describe(job.costs, ep, span.nodes)}"
            + ("; the profile's MoE layers were measured at this degree, their all-to-alls in their F and B, so only "
               "the hidden part is taken from the step" if in_blocks else ""))
    totals = CollectiveTotals(count, total, exposed, job.placed("ep", count, A2A, nbytes))
    return dataclasses.replace(step, extra_s=extra, notes=(*step.notes, note),
                               collectives={**step.collectives, A2A.value: totals}, comm_spans=spans)


def _has_pairs(schedule: Schedule) -> bool:
    return any(a.type is ActionType.OVERLAP_F_B for row in schedule.actions for a in row)
