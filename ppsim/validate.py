"""Schedule validation: the checks `ppsim validate` runs and every generated schedule passes in tests.

Rules (dependencies from :mod:`ppsim.deps`):
- each action is a compute action on a stage its rank owns (each stage on one rank);
- microbatch ids are in range; every (stage, microbatch) has exactly one F and either one B or one I and one W;
- on its rank, F comes before B/I and I before W;
- an in-order execution (each rank runs its list front to back, waiting for its inputs) finishes: no deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ppsim.costs import StageCosts
from ppsim.errors import DeadlockError, PPSimError
from ppsim.ir import ActionType, Schedule
from ppsim.simulator import compile_schedule, read_computations, run

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
    cols: list[int] = []
    skip, c = set(idle), 0
    while len(cols) < n:
        if c not in skip:
            cols.append(c)
        c += 1
    return cols


def validate(schedule: Schedule) -> list[Problem]:
    """Every problem found in ``schedule`` (empty when valid). The deadlock check runs only on sound orders.

    A sound order (the common case) is recognised with array operations; only an order with a problem is walked
    action by action, to name each problem where it is."""
    if _sound(schedule):
        return _deadlock_problems(schedule)
    return _walk(schedule) or _deadlock_problems(schedule)


def _walk(schedule: Schedule) -> list[Problem]:
    """Every problem but a deadlock, found by walking the order action by action."""
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
    return problems


def _deadlock_problems(schedule: Schedule) -> list[Problem]:
    """The deadlock check of a sound order, as problems (one per blocked rank)."""
    try:
        check_progress(schedule)
    except DeadlockError as exc:
        problems = []
        for rank, (head, waits) in sorted(exc.blocked.items()):
            pos = [str(a) for a in schedule.actions[rank]].index(head)  # each blocked rank's row once: linear
            problems.append(Problem(rank, _positions(schedule, rank)[pos], head, f"deadlock: waits for {waits}"))
        return problems
    return []


def _sound(schedule: Schedule) -> bool:
    """Whether every rule but progress holds (then the walk in :func:`validate` would find nothing), with arrays.

    False as soon as anything is off, including what the simulator's reader refuses; :func:`validate` then walks the
    order to name each problem."""
    offsets = np.zeros(schedule.num_ranks + 1, dtype=np.int64)
    np.cumsum([len(row) for row in schedule.actions], out=offsets[1:])
    try:
        c_owner, c_stage, c_code, c_mb, single_idx, _, pair_idx, pair_first = read_computations(schedule, offsets)
    except PPSimError:
        return False
    n, num_comps = int(offsets[-1]), len(c_owner)
    num_stages, num_mb = schedule.num_stages, schedule.microbatches_per_pipeline
    if len(single_idx) + len(pair_idx) != n or num_stages * num_mb * 2 > num_comps or num_mb < 1:
        return False  # a non-compute action, or too few computations to be complete
    if int(c_stage.min()) < 0 or int(c_stage.max()) >= num_stages:
        return False
    if int(c_mb.min()) < 0 or int(c_mb.max()) >= num_mb:
        return False
    rank_of_action = np.repeat(np.arange(schedule.num_ranks), np.diff(offsets))
    if not (np.asarray(schedule.stage_to_rank)[c_stage] == rank_of_action[c_owner]).all():
        return False
    own_pair = (c_stage[pair_first] == c_stage[pair_first + 1]) & (c_mb[pair_first] == c_mb[pair_first + 1])
    if own_pair.any():
        return False  # a pair overlapping a backward with its own forward
    key = (c_stage * num_mb + c_mb) * 4 + c_code
    counts = np.bincount(key, minlength=num_stages * num_mb * 4).reshape(-1, 4)
    if int(counts.max()) > 1:
        return False  # a duplicate
    f, b, i, w = counts.T
    if not ((f == 1) & (((b == 1) & (i == 0) & (w == 0)) | ((b == 0) & (i == 1) & (w == 1)))).all():
        return False  # a missing or doubled backward
    # on its rank, F comes before B or I, and I before W (computations are numbered in order, rank by rank)
    index = np.zeros(num_stages * num_mb * 4, dtype=np.int64)
    index[key] = np.arange(num_comps)
    own = key - c_code  # the F key of each computation's (stage, microbatch)
    backward = (c_code == 1) | (c_code == 2)
    if not (index[own[backward]] < np.flatnonzero(backward)).all():
        return False
    weight = np.flatnonzero(c_code == 3)
    return bool((index[own[weight] + 2] < weight).all())


def check_progress(schedule: Schedule) -> None:
    """Raise :class:`DeadlockError` unless every rank can run its order front to back (time plays no part).

    This is the simulator's own engine (:func:`ppsim.simulator.compile_schedule` and :func:`ppsim.simulator.run`) on
    zero costs, not a second replay: progress does not depend on durations, and the engine is linear in actions.
    Call it on a schedule without format problems (``validate`` does)."""
    run(compile_schedule(schedule, _UNTIMED))


_UNTIMED = StageCosts(F=(0.0,), B=(0.0,), I=(0.0,), W=(0.0,), FB=(0.0,), comm=0.0, source="untimed")
