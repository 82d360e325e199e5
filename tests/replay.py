"""The one reference replay of the test suite: a deliberately naive in-order execution.

Written from the two sources of truth only (``ppsim.deps`` for inputs, ``CostModel.duration`` and
``CostModel.comm_delay`` for times), independent of ``ppsim.simulate``: sweep the ranks, run each head action whose
inputs are all done, until nothing moves. Ranks left with actions are stuck (a deadlock).

A cross-rank hand-off is posted when its producer ends, or with ``recv_posting="consumer"`` at the later of that and
the end of the consumer rank's previous action; it arrives ``comm_delay`` after being posted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppsim import deps
from ppsim.costs import CostModel
from ppsim.ir import ActionType, Schedule


@dataclass(frozen=True)
class Replay:
    starts: list[list[float]]  # per rank, per executed action
    ends: list[list[float]]
    busy: list[float]  # per rank: the sum of its durations
    stuck: dict[int, str]  # rank -> head action it cannot run

    @property
    def makespan(self) -> float:
        return max((row[-1] for row in self.ends if row), default=0.0)

    @property
    def first_start(self) -> tuple[float, ...]:
        return tuple(row[0] if row else float("inf") for row in self.starts)

    @property
    def last_end(self) -> tuple[float, ...]:
        return tuple(row[-1] if row else 0.0 for row in self.ends)


def replay(schedule: Schedule, costs: CostModel) -> Replay:
    """Run every rank's order front to back; an action starts when its rank is free and its inputs have arrived."""
    done: dict[deps.Key, tuple[float, int]] = {}  # key -> (end, rank)
    ptr = [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    starts: list[list[float]] = [[] for _ in range(schedule.num_ranks)]
    ends: list[list[float]] = [[] for _ in range(schedule.num_ranks)]
    consumer_posting = costs.recv_posting == "consumer"
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
                duration = costs.duration(schedule, action)
                end = t + duration
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
    return Replay(starts, ends, busy, stuck)


def unit_costs(table: dict[ActionType, float]) -> CostModel:
    """A cost model from per-kind times (no communication), for closed-form checks."""
    f, b = table.get(ActionType.F, 1.0), table.get(ActionType.B, 2.0)
    i, w = table.get(ActionType.I, b / 2), table.get(ActionType.W, b / 2)
    return CostModel(F=(f,), B=(b,), I=(i,), W=(w,), FB=(f + b,), source="test")
