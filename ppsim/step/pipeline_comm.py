"""The pipeline's hand-offs on their links: the PP pass of the one step model.

torch's runtime sends each stage's output (and each input gradient back) to the neighbouring stage's rank. PP is the
outermost dimension of torchtitan's mesh, so two PP ranks are ``dp_replicate x dp_shard x cp x tp`` ranks apart and
leave the node once that stride reaches a node's GPUs (:class:`ppsim.step.placement.Placement` ``pp_crosses``; an
interleaved or V order's wrap from the last rank to the first counted the same way). A hand-off within a node keeps
the costs' own p2p model (the profile's measured fit); one across nodes is priced as a ``send_recv`` on a
two-node span (:meth:`ppsim.step.pricing.CollectiveCosts.seconds`: the cluster's inter-node link, or a profile's
cross-node samples), as ``alpha + bytes / beta`` per pair of ranks in the costs the simulator replays
(:attr:`ppsim.costs.StageCosts.rank_links`). Without a placement or a cluster the costs are unchanged. This module
imports no torch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ppsim.result import CollectiveTotals, GroupPlacement
from ppsim.step.kinds import CollectiveKind
from ppsim.step.model import Step

if TYPE_CHECKING:
    from ppsim.step.job import StepJob

P2P = CollectiveKind.SEND_RECV
PROBE_BYTES = 64 * 2**20
"""The size at which a link's bandwidth is read off its price (``beta = size / (t(size) - t(1))``)."""


def cross_link(job: StepJob) -> tuple[float, float | None] | None:
    """``(alpha, beta)`` of a hand-off between two nodes in the simulation's unit, or ``None`` without a price."""
    costs = job.costs
    if costs is None or costs.cluster is None:
        return None
    t1 = costs.seconds(P2P, 1, group_size=2, nodes=2)
    tn = costs.seconds(P2P, PROBE_BYTES, group_size=2, nodes=2)
    scale = job.time_scale
    if tn <= t1:
        return t1 / scale, None
    beta = (PROBE_BYTES - 1) / (tn - t1) * scale
    return t1 / scale, beta


def pipeline_pass(step: Step, stage_costs: Any, job: StepJob) -> Step:
    """``step`` with the hand-offs between PP ranks on different nodes priced on their link (module docstring)."""
    placement = job.placement
    if placement is None or not any(placement.pp_crosses) and not _wraps_across(job):
        return step
    link = cross_link(job)
    if link is None:
        return step
    alpha, beta = link
    if beta is None or stage_costs.output_bytes is None:  # a flat delay: one microbatch's activations
        nbytes = job.activation_bytes
        flat = job.costs.seconds(P2P, nbytes, group_size=2, nodes=2) / job.time_scale if nbytes and job.costs \
            else alpha
        alpha, beta = flat, None
    pairs = crossing_pairs(job)
    links = {**(stage_costs.rank_links or {}), **{pair: (alpha, beta) for pair in pairs}}
    costs = dataclasses.replace(step.costs if step.costs is not None else stage_costs, rank_links=links)
    stride = placement.degrees.world_size // placement.degrees.pp
    how = (f"{alpha * job.time_scale * 1e6:.1f} us + bytes / {beta / job.time_scale / 1e9:.3g} GB/s"
           if beta is not None else f"{alpha:.4g} per hand-off")
    note = (f"PP: {len(pairs)} of {placement.degrees.pp - 1 + _wrap(job)} neighbouring PP rank pairs sit on different "
            f"nodes (PP ranks {stride} GPUs apart, {placement.gpus_per_node} a node): their hand-offs cross the "
            f"network, {how} ({job.costs.source(P2P, 2, 2) if job.costs else ''})")
    count, total = _crossing_handoffs(step, costs, set(pairs))
    placed = GroupPlacement(group="pp", ranks=2, nodes=2, ranks_per_node=1, algorithm="p2p", count=count)
    # a hand-off delays its consumer, not a compute stream: none of it is counted as exposed here (the bubble is)
    totals = CollectiveTotals(count, total, 0.0, (placed,))
    return dataclasses.replace(step, costs=costs, notes=(*step.notes, note),
                               collectives={**step.collectives, P2P.value: totals})


def _crossing_handoffs(step: Step, costs: Any, pairs: set[tuple[int, int]]) -> tuple[int, float]:
    """How many hand-offs of the step cross nodes (each microbatch's activation forward and gradient back over each
    crossing boundary of each chain) and their time."""
    schedule = step.schedule
    count, total = 0, 0.0
    per_chain = schedule.num_microbatches // len(schedule.pipelines)
    for chain in schedule.pipelines:
        for a, b in zip(chain, chain[1:]):
            ranks = schedule.stage_to_rank[a], schedule.stage_to_rank[b]
            if (min(ranks), max(ranks)) in pairs:
                count += 2 * per_chain
                total += per_chain * (costs.comm_delay(schedule, a, b) + costs.comm_delay(schedule, b, a))
    return count, total


def _wrap(job: StepJob) -> int:
    return 1 if job.degrees.pp > 2 else 0


def _node(job: StepJob, pp_rank: int) -> int:
    assert job.placement is not None
    stride = job.degrees.world_size // job.degrees.pp
    return (pp_rank * stride) // job.placement.gpus_per_node


def _wraps_across(job: StepJob) -> bool:
    return job.degrees.pp > 2 and _node(job, 0) != _node(job, job.degrees.pp - 1)


def crossing_pairs(job: StepJob) -> list[tuple[int, int]]:
    """The pairs of PP ranks (lower first) that hand off across nodes: neighbours, and the last rank with the first
    (an interleaved order's wrap)."""
    pp = job.degrees.pp
    pairs = [(j, j + 1) for j in range(pp - 1) if _node(job, j) != _node(job, j + 1)]
    if _wraps_across(job):
        pairs.append((0, pp - 1))
    return pairs
