"""Context parallelism's collectives in a pipeline's simulated step: the CP pass of the one step model
(:func:`ppsim.step.build.build_step`), after EP's.

**What is issued** (torchtitan 0.3.0, FlexAttention path: ``apply_cp_to_forward`` wraps each layer's inner attention
with torch's ``flex_cp_allgather``). Each transformer layer's forward all-gathers its K and V over the ``cp`` ranks
(two all-gathers, each of ``cp x`` one rank's share: ``JobShapes.cp_kv_bytes`` for K and V together); its backward
reduce-scatters their gradients (``flex_cp_allgather_backward``: two reduce-scatters of the same size). Under
selective or full activation checkpointing the backward first reruns the forward's all-gathers (the gather is not
an op the selective policy saves; full recomputes the whole layer). So a stage of ``L`` layers issues ``2L``
all-gathers per F, ``2L`` reduce-scatters per B or I (plus ``2L`` all-gathers when checkpointed); W none.

**What one costs**: :meth:`ppsim.step.pricing.CollectiveCosts.seconds` on the ``cp`` group's placement (measured
samples, else the cluster's model, else the p2p fit), divided by the simulation's seconds per unit.

**Where it is exposed**: all of it, added to the action (``extra_s``): the gather is a blocking functional
collective (``.wait()`` before the attention) and torchtitan 0.3.0 does not overlap it with compute. Approximated:
torch's SDPA path (ring attention, used where the model's attention is SDPA) exchanges K/V chunks in rounds that can
overlap the attention; it is priced here as the same all-gather. This module imports no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ppsim.ir import ActionType, Schedule
from ppsim.result import CollectiveTotals, CommSpan
from ppsim.step.kinds import CollectiveKind
from ppsim.step.model import Step

if TYPE_CHECKING:
    from ppsim.step.job import StepJob

AG, RS = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER


def layers_of(modules: Sequence[str]) -> int:
    """A stage's transformer layers (each one attention)."""
    return sum(1 for m in modules if m.startswith("layers."))


def _stage_modules(schedule: Schedule, stage_modules: Sequence[Sequence[str]], stage: int) -> Sequence[str]:
    return stage_modules[stage] if len(stage_modules) == schedule.num_stages else stage_modules[
        schedule.position(stage)]


def cp_pass(step: Step, stage_costs: Any, job: StepJob) -> Step:
    """``step`` with CP's K/V all-gathers (F; again in a checkpointed backward) and their gradients' reduce-scatters
    (B or I) added to its actions. At ``cp`` 1, ``step`` unchanged; without any price, a note says so."""
    cp = job.degrees.cp
    if cp <= 1:
        return step
    shapes, costs = job.shapes, job.costs
    nbytes = cp * int(getattr(shapes, "cp_kv_bytes", 0) or 0)  # the gathered tensor, K and V together
    if costs is None or not costs.can_price(AG) or nbytes <= 0:
        return step.plus(note=f"CP (cp {cp}): its K/V all-gathers are not in the step (no price: no profile "
                              "collectives, p2p fit or --cluster, or no K/V size in the shapes)")
    span = job.span("cp")
    half = nbytes // 2  # one all-gather moves K, another V
    gather = 2 * costs.seconds(AG, half, group_size=span.ranks, nodes=span.nodes) / job.time_scale
    scatter = 2 * costs.seconds(RS, half, group_size=span.ranks, nodes=span.nodes) / job.time_scale
    recompute = getattr(shapes, "activation_checkpoint", "none") in ("selective", "full")
    schedule = step.schedule
    layers = [layers_of(_stage_modules(schedule, job.stage_modules, s)) for s in range(schedule.num_stages)]
    extra = dict(step.extra_s)
    spans = dict(step.comm_spans)
    n_ag = n_rs = 0
    t_ag = t_rs = 0.0
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            if not action.is_compute:
                continue
            added = 0.0
            for c in action.computations:
                n = layers[c.stage]
                if not n:
                    continue
                if c.type is ActionType.F:
                    n_ag, t_ag, added = n_ag + 2 * n, t_ag + n * gather, added + n * gather
                elif c.type in (ActionType.B, ActionType.I):
                    again = n * gather if recompute else 0.0
                    n_ag, t_ag = n_ag + (2 * n if recompute else 0), t_ag + again
                    n_rs, t_rs = n_rs + 2 * n, t_rs + n * scatter
                    added += again + n * scatter
            if added:
                extra[(rank, pos)] = extra.get((rank, pos), 0.0) + added
                spans[(rank, pos)] = spans.get((rank, pos), CommSpan(0.0, 0.0)).plus(added, added, AG.value,
                                                                                       span.nodes > 1)
    merged = dict(step.collectives)
    for kind, count, total in ((AG, n_ag, t_ag), (RS, n_rs, t_rs)):
        mine = CollectiveTotals(count, total, total, job.placed("cp", count, kind, half))
        merged[kind.value] = mine if kind.value not in merged else merged[kind.value] + mine
    unit = "s" if getattr(stage_costs, "unit", "s") == "s" else " units"
    where = f" over {span.nodes} nodes" if span.nodes > 1 else ""
    note = (f"CP (cp {cp}{where}): each layer all-gathers K and V in F ({nbytes / 2**20:.2f} MiB gathered per layer "
            f"and microbatch) and reduce-scatters their gradients in B/I" + (", regathering them first (the "
            "backward recomputes the forward)" if recompute else "") + f"; {n_ag} all-gathers and {n_rs} "
            f"reduce-scatters, {t_ag + t_rs:.4g}{unit}, all exposed (torchtitan does not overlap them); "
            f"{costs.source(AG, span.ranks, span.nodes)}")
    return dataclasses.replace(step, extra_s=extra, notes=(*step.notes, note), collectives=merged,
                               comm_spans=spans)
