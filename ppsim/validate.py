"""Schedule validation: the checks `ppsim validate` runs and every generated schedule passes in tests.

Rules (dependencies from :mod:`ppsim.deps`):
- each action is a compute action on a stage its rank owns (each stage on one rank);
- microbatch ids are in range; every (stage, microbatch) has exactly one F and either one B or one I and one W;
- on its rank, F comes before B/I and I before W;
- an in-order execution (each rank runs its list front to back, waiting for its inputs) finishes: no deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppsim.costs import CostModel
from ppsim.errors import DeadlockError
from ppsim.ir import ActionType, Schedule
from ppsim.simulate import compile_schedule, run

F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W
_MAX_MISSING = 100  # missing computations listed one by one


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a schedule, located by rank and position (column in the rank's row)."""

    rank: int | None
    position: int | None
    action: str | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.position is not None:
            where.append(f"position {self.position}")
        if self.action is not None:
            where.append(f"action {self.action}")
        return (", ".join(where) + ": " if where else "") + self.message


def _positions(schedule: Schedule, rank: int) -> list[int]:
    """Column of each action of ``rank`` in its written row (idle cells from a CSV count as columns)."""
    n = len(schedule.actions[rank])
    idle = schedule.idle_slots[rank] if rank < len(schedule.idle_slots) else ()
    if not idle:
        return list(range(n))
    cols, skip, c = [], set(idle), 0
    while len(cols) < n:
        if c not in skip:
            cols.append(c)
        c += 1
    return cols


def validate(schedule: Schedule) -> list[Problem]:
    """Every problem found in ``schedule`` (empty when valid). The deadlock check runs only on sound orders."""
    problems: list[Problem] = []
    per_pipeline = schedule.microbatches_per_pipeline
    seen: dict[tuple[int, int, ActionType], tuple[int, int]] = {}
    for rank, row in enumerate(schedule.actions):
        cols = _positions(schedule, rank)
        for pos, action in enumerate(row):
            col = cols[pos]
            if not action.is_compute:
                problems.append(Problem(rank, col, str(action), f"{action.type.value} is not a compute action"))
                continue
            for comp in action.computations:
                s, mb = comp.stage, comp.microbatch
                if not 0 <= s < schedule.num_stages:
                    problems.append(Problem(rank, col, str(action), f"stage {s} out of range 0..{schedule.num_stages - 1}"))
                    continue
                if schedule.stage_to_rank[s] != rank:
                    problems.append(
                        Problem(rank, col, str(action), f"stage {s} belongs to rank {schedule.stage_to_rank[s]}")
                    )
                if mb is None or not 0 <= mb < per_pipeline:
                    problems.append(
                        Problem(rank, col, str(action), f"microbatch {mb} out of range 0..{per_pipeline - 1}")
                    )
                    continue
                key = (s, mb, comp.type)
                if key in seen:
                    r0, c0 = seen[key]
                    problems.append(
                        Problem(rank, col, str(action), f"duplicate {comp}: already at rank {r0}, position {c0}")
                    )
                    continue
                seen[key] = (rank, col)
                if comp.type in (B, I) and (s, mb, F) not in seen:
                    problems.append(Problem(rank, col, str(action), f"{comp} runs before its forward {s}F{mb}"))
                if comp.type is W and (s, mb, I) not in seen:
                    problems.append(Problem(rank, col, str(action), f"{comp} runs before its input backward {s}I{mb}"))
                if action.sub_actions and comp.type is not F:
                    fwd = action.sub_actions[0]
                    if fwd.stage == s and fwd.microbatch == mb:
                        problems.append(
                            Problem(rank, col, str(action), f"pair overlaps {comp} with its own forward")
                        )
    # each (stage, microbatch) visited is complete (two actions present) or listed: the loop stays linear in actions
    listed = 0
    for s, mb in ((s, mb) for s in range(schedule.num_stages) for mb in range(per_pipeline)):
        if listed == _MAX_MISSING:
            problems.append(Problem(None, None, None, f"more computations are missing (listed the first "
                                    f"{_MAX_MISSING}); check the microbatch count and the stages"))
            break
        rank = schedule.stage_to_rank[s]
        before = len(problems)
        has = {t for t in (F, B, I, W) if (s, mb, t) in seen}
        if F not in has:
            problems.append(Problem(rank, None, f"{s}F{mb}", f"missing forward {s}F{mb}"))
        if B in has and (I in has or W in has):
            problems.append(Problem(rank, None, f"{s}B{mb}", f"stage {s} microbatch {mb} has both B and I/W"))
        elif B not in has and not (I in has and W in has):
            what = f"{s}W{mb}" if I in has else (f"{s}I{mb}" if W in has else f"{s}B{mb} (or {s}I{mb} and {s}W{mb})")
            problems.append(Problem(rank, None, what.split(" ")[0], f"missing backward {what}"))
        listed += len(problems) > before
    if not problems:
        try:
            check_progress(schedule)
        except DeadlockError as exc:
            for rank, (head, waits) in sorted(exc.blocked.items()):
                pos = [str(a) for a in schedule.actions[rank]].index(head)  # each blocked rank's row once: linear
                problems.append(Problem(rank, _positions(schedule, rank)[pos], head, f"deadlock: waits for {waits}"))
    return problems


def check_progress(schedule: Schedule) -> None:
    """Raise :class:`DeadlockError` unless every rank can run its order front to back (time plays no part).

    This is the simulator's own engine (:func:`ppsim.simulate.compile_schedule` and :func:`ppsim.simulate.run`) on
    zero costs, not a second replay: progress does not depend on durations, and the engine is linear in actions.
    Call it on a schedule without format problems (``validate`` does)."""
    run(compile_schedule(schedule, _UNTIMED))


_UNTIMED = CostModel(F=(0.0,), B=(0.0,), I=(0.0,), W=(0.0,), FB=(0.0,), comm=0.0, source="untimed")
