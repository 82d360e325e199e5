"""Test helpers for schedule properties: the reference replay (:mod:`replay`) with per-kind costs, and activation
counts.

Independent of ``ppsim.simulator`` on purpose: these are the reference the generators are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay import replay as reference_replay
from replay import unit_costs

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
    """The reference replay (:mod:`replay`) with per-kind costs and zero communication; AssertionError on a
    deadlock."""
    ref = reference_replay(schedule, unit_costs(costs))
    assert not ref.stuck, f"{schedule.name} deadlocks at heads {ref.stuck}"
    return Replay(ref.makespan, ref.first_start, ref.last_end, tuple(ref.busy))


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
