"""What the step model's passes need of a training job (:class:`StepJob`): its shapes, stage modules, degrees, the
prices of its collectives and where its groups sit. This module imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ppsim.job.degrees import Degrees
from ppsim.result import GroupPlacement
from ppsim.step.collectives import Span
from ppsim.step.kinds import CollectiveKind
from ppsim.step.placement import Placement, groups
from ppsim.step.pricing import CollectiveCosts

TYPICAL_BYTES = 16 * 2**20
"""The message size at which a group's algorithm is reported (``placement[].algorithm``)."""


@dataclass(frozen=True)
class StepJob:
    """What the passes need of the job: its shapes (:class:`ppsim.job.memory.JobShapes`, one TP rank's blocks), each
    stage's modules (one list per stage, or per chain position for a DualPipe), its degrees, the prices, and where
    its groups sit."""

    shapes: Any
    stage_modules: Sequence[Sequence[str]]
    degrees: Degrees
    costs: CollectiveCosts | None
    placement: Placement | None = None
    """``None``: every group within one host (a profile's own host; no cluster given)."""
    time_scale: float = 1.0
    """Seconds per cost unit of the simulation (1 with a profile; the plan's unit costs otherwise)."""
    ep_overlap: str = "dualpipe"
    """How overlapped F&B pairs treat EP's all-to-alls (:data:`ppsim.step.ep.OVERLAPS`)."""
    ep_in_blocks: bool = False
    """The profile's MoE layers were measured at this EP degree, their all-to-alls inside their F and B."""
    shared: tuple[int, int] | None = None
    """``(processes per PP rank, cores)``: local processes sharing one host's cores (:mod:`ppsim.step.sharing`)."""
    shared_scale: float = 1.0
    activation_bytes: int = 0
    runtime_order: bool = False
    """The order runs in torch's ``_PipelineScheduleRuntime`` as an action list (``ppsim run`` and calibration's
    probe, either runner): every rank's ``UNSHARD`` at the step's start, whatever the schedule. ``False``: the
    schedule torchtitan builds by name, whose single-stage classes (GPipe, 1F1B) gather inside the first forward."""
    """One microbatch's hand-off between PP ranks, for costs without a byte table (the plan's unit costs)."""

    def span(self, name: str) -> Span:
        """Where the group of dimension ``name`` sits (:data:`ppsim.step.placement.DIMENSIONS`); without a
        placement, within one node."""
        if self.placement is not None:
            return self.placement.span(name)
        group = groups(self.degrees).get(name)
        return Span(group.size if group is not None else 1, 1)

    def placed(self, name: str, count: int, kind: CollectiveKind,
               nbytes: int = TYPICAL_BYTES) -> tuple[GroupPlacement, ...]:
        """The ``placement`` entries of ``simulate --json`` for ``count`` collectives of ``kind`` on group
        ``name``: none without a cluster (every group on one host)."""
        return () if self.placement is None else (self.group_placement(name, count, kind, nbytes),)

    def group_placement(self, name: str, count: int, kind: CollectiveKind,
                        nbytes: int = TYPICAL_BYTES) -> GroupPlacement:
        """One ``placement`` entry: where group ``name`` sits and the algorithm its model chose."""
        span = self.span(name)
        algorithm = "measured" if self.costs is not None and self.costs._nearest(kind.value, span.ranks, span.nodes) \
            else "unpriced"
        if algorithm != "measured" and self.costs is not None:
            cluster = self.costs.model_cluster()
            if cluster is not None and span.ranks > 1:
                from ppsim.step.collectives import predict

                chosen = predict(kind, nbytes, span, cluster)
                algorithm = f"{chosen.algorithm}/{chosen.protocol}"
            elif self.costs.has_p2p:
                algorithm = "p2p fit"
        return GroupPlacement(group=name, ranks=span.ranks, nodes=span.nodes,
                              ranks_per_node=span.ranks // max(span.nodes, 1), algorithm=algorithm, count=count)
