"""The one reference replay of the test suite: a deliberately naive in-order execution.

Written from the two sources of truth only (``ppsim.deps`` for inputs, ``StageCosts.duration`` and
``StageCosts.comm_delay`` for times), independent of ``ppsim.simulator``: sweep the ranks, run each head action whose
inputs are all done, until nothing moves. Ranks left with actions are stuck (a deadlock).

A cross-rank hand-off is posted when its producer ends, or with ``recv_posting="consumer"`` at the later of that and
the end of the consumer rank's previous action; it arrives ``comm_delay`` after being posted.

Memory is replayed too, action by action from the rule in docs/simulator.md (with activation recomputation: a
recomputed (stage, microbatch) holds ``StageCosts.recompute_kept`` after its F; its B or I re-materialises the rest
before releasing), with exact integers: activation counts in ``ACTIVATION_PARTS`` of one activation, and bytes.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

from ppsim import deps
from ppsim.costs import ACTIVATION_PARTS, StageCosts
from ppsim.ir import ActionType, Schedule


@dataclass(frozen=True)
class Replay:
    starts: list[list[float]]  # per rank, per executed action
    ends: list[list[float]]
    busy: list[float]  # per rank: the sum of its durations
    stuck: dict[int, str]  # rank -> head action it cannot run
    peak_parts: list[int] = field(default_factory=list)  # per rank: most activations held, in ACTIVATION_PARTS
    peak_bytes: list[int] = field(default_factory=list)  # per rank: most activation bytes held (0 without sizes)

    @property
    def peak_activations(self) -> list[int | float]:
        return [p // ACTIVATION_PARTS if p % ACTIVATION_PARTS == 0 else p / ACTIVATION_PARTS for p in self.peak_parts]

    @property
    def makespan(self) -> float:
        return max((row[-1] for row in self.ends if row), default=0.0)

    @property
    def first_start(self) -> tuple[float, ...]:
        return tuple(row[0] if row else float("inf") for row in self.starts)

    @property
    def last_end(self) -> tuple[float, ...]:
        return tuple(row[-1] if row else 0.0 for row in self.ends)


def replay(schedule: Schedule, costs: StageCosts, recompute: Set[tuple[int, int]] = frozenset()) -> Replay:
    """Run every rank's order front to back; an action starts when its rank is free and its inputs have arrived."""
    done: dict[deps.Key, tuple[float, int]] = {}  # key -> (end, rank)
    ptr = [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    starts: list[list[float]] = [[] for _ in range(schedule.num_ranks)]
    ends: list[list[float]] = [[] for _ in range(schedule.num_ranks)]
    consumer_posting = costs.recv_posting == "consumer"
    held = [[0, 0] for _ in range(schedule.num_ranks)]  # per rank: [parts, bytes] held now
    peak = [[0, 0] for _ in range(schedule.num_ranks)]
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(schedule.actions):
            while ptr[r] < len(row):
                action = row[ptr[r]]
                t = free[r]
                ready = True
                for comp in action.computations:
                    for key in deps.requires(schedule, comp):
                        if key not in done:
                            ready = False
                            break
                        end, rank = done[key]
                        if rank != r:
                            posted = max(end, free[r]) if consumer_posting else end
                            end = posted + costs.comm_delay(schedule, key[0], comp.stage)
                        t = max(t, end)
                    if not ready:
                        break
                if not ready:
                    break
                backward = action.computations[-1]
                rc = (backward.stage, backward.microbatch) in recompute and backward.type in (ActionType.B, ActionType.I)
                duration = costs.duration(schedule, action, recomputed=rc)
                end = t + duration
                _memory(schedule, costs, action, recompute, held[r], peak[r])
                for comp in action.computations:
                    for key in deps.provides(comp):
                        done[key] = (end, r)
                starts[r].append(t)
                ends[r].append(end)
                free[r] = end
                busy[r] += duration
                ptr[r] += 1
                moved = True
    stuck = {r: str(row[ptr[r]]) for r, row in enumerate(schedule.actions) if ptr[r] < len(row)}
    return Replay(starts, ends, busy, stuck, [p[0] for p in peak], [p[1] for p in peak])


def _memory(schedule: Schedule, costs: StageCosts, action: object, recompute: Set[tuple[int, int]],
            held: list[int], peak: list[int]) -> None:
    """One action's effect on its rank's memory: everything it adds (a pair's forward, a recomputed forward) is
    held before anything it releases."""
    adds = [0, 0]
    frees = [0, 0]
    for comp in action.computations:  # type: ignore[attr-defined]
        if comp.type not in (ActionType.F, ActionType.B, ActionType.I, ActionType.W):
            continue
        size, freed_by_i = costs.activation_of(schedule, comp.stage)
        one = (ACTIVATION_PARTS, size)
        kept_bytes, kept_parts = costs.recompute_kept(schedule, comp.stage)
        kept = (kept_parts, kept_bytes)
        rc = (comp.stage, comp.microbatch) in recompute
        for j in (0, 1):
            if comp.type is ActionType.F:
                adds[j] += kept[j] if rc else one[j]
                continue
            if rc and comp.type in (ActionType.B, ActionType.I):
                adds[j] += one[j] - kept[j]  # the recomputed forward brings the rest back
            if comp.type is ActionType.B:
                frees[j] += one[j]
            elif comp.type is ActionType.I:
                frees[j] += (0, freed_by_i)[j]  # counted: I releases none
            else:
                frees[j] += one[j] - (0, freed_by_i)[j]
    for j in (0, 1):
        peak[j] = max(peak[j], held[j] + adds[j])
        held[j] += adds[j] - frees[j]


def unit_costs(table: dict[ActionType, float]) -> StageCosts:
    """A cost model from per-kind times (no communication), for closed-form checks."""
    f, b = table.get(ActionType.F, 1.0), table.get(ActionType.B, 2.0)
    i, w = table.get(ActionType.I, b / 2), table.get(ActionType.W, b / 2)
    return StageCosts(F=(f,), B=(b,), I=(i,), W=(w,), FB=(f + b,), source="test")
