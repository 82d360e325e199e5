"""Test helpers for schedule properties: an in-order longest-path replay over :mod:`ppsim.deps` and activation counts.

Independent of ``ppsim.simulate`` on purpose: these are the reference the generators are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppsim import deps
from ppsim.ir import ActionType, Schedule

UNIT = {ActionType.F: 1.0, ActionType.B: 2.0, ActionType.I: 1.0, ActionType.W: 1.0}


@dataclass(frozen=True)
class Replay:
    makespan: float
    first_start: tuple[float, ...]  # per rank
    last_end: tuple[float, ...]
    busy: tuple[float, ...]

    @property
    def spans(self) -> tuple[float, ...]:
        return tuple(e - s for s, e in zip(self.first_start, self.last_end))

    @property
    def idle(self) -> tuple[float, ...]:
        """Idle time per rank within the whole step (0 .. makespan)."""
        return tuple(self.makespan - b for b in self.busy)


def replay(schedule: Schedule, costs: dict[ActionType, float] = UNIT) -> Replay:
    """Each rank runs its order front to back; an action starts when its rank is free and its inputs exist.

    Zero communication; single computations only (no overlapped pairs). Raises AssertionError on a deadlock.
    """
    ready: dict[deps.Key, float] = {}
    heads = [0] * schedule.num_ranks
    clock = [0.0] * schedule.num_ranks
    first = [float("inf")] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    pending = sum(len(row) for row in schedule.actions)
    while pending:
        moved = False
        for r, row in enumerate(schedule.actions):
            while heads[r] < len(row):
                action = row[heads[r]]
                assert not action.sub_actions, "replay handles single computations only"
                need = deps.requires(schedule, action)
                if any(k not in ready for k in need):
                    break
                start = max([clock[r], *(ready[k] for k in need)])
                end = start + costs[action.type]
                for k in deps.provides(action):
                    ready[k] = end
                first[r] = min(first[r], start)
                clock[r] = end
                busy[r] += costs[action.type]
                heads[r] += 1
                pending -= 1
                moved = True
        assert moved, f"{schedule.name} deadlocks at heads {heads}"
    return Replay(max(clock), tuple(first), tuple(clock), tuple(busy))


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most stage activations held at once: +1 at F, -1 at B or W (order = time on one rank)."""
    peaks = []
    for row in schedule.actions:
        held = peak = 0
        for action in row:
            for comp in action.computations:
                if comp.type is ActionType.F:
                    held += 1
                    peak = max(peak, held)
                elif comp.type in (ActionType.B, ActionType.W):
                    held -= 1
        peaks.append(peak)
    return tuple(peaks)
