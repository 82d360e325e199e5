"""Schedule validation: the checks `ppsim validate` runs and every generated schedule passes in tests.

Rules (dependencies from :mod:`ppsim.deps`):
- each action is a compute action on a stage its rank owns (each stage on one rank);
- microbatch ids are in range; every (stage, microbatch) has exactly one F and either one B or one I and one W;
- on its rank, F comes before B/I and I before W;
- an in-order execution (each rank runs its list front to back, waiting for its inputs) finishes: no deadlock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ppsim import deps
from ppsim.errors import DeadlockError
from ppsim.ir import Action, ActionType, Schedule

F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W


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
    for s in range(schedule.num_stages):
        rank = schedule.stage_to_rank[s]
        for mb in range(per_pipeline):
            has = {t for t in (F, B, I, W) if (s, mb, t) in seen}
            if F not in has:
                problems.append(Problem(rank, None, f"{s}F{mb}", f"missing forward {s}F{mb}"))
            if B in has and (I in has or W in has):
                problems.append(Problem(rank, None, f"{s}B{mb}", f"stage {s} microbatch {mb} has both B and I/W"))
            elif B not in has and not (I in has and W in has):
                what = f"{s}W{mb}" if I in has else (f"{s}I{mb}" if W in has else f"{s}B{mb} (or {s}I{mb} and {s}W{mb})")
                problems.append(Problem(rank, None, what.split(" ")[0], f"missing backward {what}"))
    if not problems:
        try:
            check_progress(schedule)
        except DeadlockError as exc:
            for rank, (head, waits) in sorted(exc.blocked.items()):
                pos = [str(a) for a in schedule.actions[rank]].index(head)
                problems.append(Problem(rank, _positions(schedule, rank)[pos], head, f"deadlock: waits for {waits}"))
    return problems


def check_progress(schedule: Schedule) -> None:
    """Run every rank's order in sequence, ignoring time; raise :class:`DeadlockError` if none can advance."""
    done: set[deps.Key] = set()
    heads = [0] * schedule.num_ranks
    rows = schedule.actions
    waiting = {r for r in range(schedule.num_ranks) if rows[r]}
    reqs_cache: dict[Action, tuple[deps.Key, ...]] = {}

    def needs(action: Action) -> tuple[deps.Key, ...]:
        out = reqs_cache.get(action)
        if out is None:
            own = {k for c in action.computations for k in deps.provides(c)}
            out = tuple(k for c in action.computations for k in deps.requires(schedule, c) if k not in own)
            reqs_cache[action] = out
        return out

    while waiting:
        progressed = False
        for r in list(waiting):
            row = rows[r]
            i = heads[r]
            while i < len(row):
                action = row[i]
                if any(k not in done for k in needs(action)):
                    break
                for c in action.computations:
                    done.update(deps.provides(c))
                i += 1
            if i != heads[r]:
                progressed = True
                heads[r] = i
            if i == len(row):
                waiting.discard(r)
        if waiting and not progressed:
            blocked: dict[int, tuple[str, str]] = {}
            for r in sorted(waiting):
                head = rows[r][heads[r]]
                missing = next(k for k in needs(head) if k not in done)
                blocked[r] = (str(head), deps.describe(missing))
            detail = "; ".join(f"rank {r} at {h} waits for {w}" for r, (h, w) in blocked.items())
            raise DeadlockError(
                f"schedule {schedule.name!r} deadlocks under in-order execution: {detail}; reorder so each "
                "producer runs before the actions its rank must finish first",
                blocked,
            )
