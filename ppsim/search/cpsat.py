"""Optional exact step for :mod:`ppsim.search` with OR-Tools' CP-SAT (``pip install ppsim[search]``): a better order,
and a proof (the order is optimal) or a proven lower bound.

The model: one interval per computation (F; B, or I and W), one no-overlap per rank, precedences with the hand-off
delays, forwards and backwards of a stage in microbatch order, and one cumulative per rank whose tasks are the
activations (from the forward's start to the release: the W's or the B's end; with bytes, the part I frees ends at
the I) under the cap. Durations are integers: the costs times 10^k when that makes them exact (``F=1,comm=0.1``:
k = 1), else scaled so that the smallest is 200 ticks and rounded down. A hint starts the solver from the incumbent;
its order is re-simulated with the exact costs by the caller.

**What a proof covers** (see docs/search.md): orders that run each stage's forwards and backwards in microbatch
order (microbatches are alike, so relabelling any order gives one), every backward split into I and W when
``I + W <= B`` on every stage (a B is then never better: I and W back to back end no later and release no later),
no overlapped pairs (only claimed when no pair is cheaper than its halves), and a cap in activations. Durations
rounded down only relax the model, so its bound stays a bound; a rounded model is never called optimal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ppsim.ir import Action, ActionType, Schedule
from ppsim.search.listsched import Problem

_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W


def available() -> bool:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Outcome:
    """What CP-SAT found: an order (or ``None``), and where the model covers every order (:func:`provable`) the
    makespan no order can beat (``bound``) and whether the solver closed the gap (``optimal``)."""

    schedule: Schedule | None
    bound: float | None
    optimal: bool


def provable(problem: Problem, *, pair_saving: float) -> bool:
    """Whether the model's optimum is the optimum over all orders (see the module docstring)."""
    S = problem.template.num_stages
    split_dominates = all(problem.i[s] + problem.w[s] <= problem.b[s] + 1e-12 for s in range(S))
    counts = all(a == 1.0 for a in problem.act) and all(c == math.inf or c == int(c) for c in problem.cap)
    return split_dominates and pair_saving <= 1e-12 and counts


def _scale(values: list[float]) -> tuple[float, bool]:
    """Ticks per time unit, and whether every value is then an exact integer."""
    for k in range(5):
        scale = 10.0**k
        if all(abs(x * scale - round(x * scale)) <= 1e-9 * max(1.0, x * scale) for x in values):
            if max(values, default=0.0) * scale < 1e7:
                return scale, True
            break
    positive = [x for x in values if x > 0]
    return (200.0 / min(positive) if positive else 1.0), False


def polish(
    problem: Problem, incumbent: Schedule, incumbent_starts: tuple[tuple[float, ...], ...], *, time_limit: float,
    seed: int, deterministic_time: float | None = None, prove: bool = False,
) -> Outcome:
    """A new order from CP-SAT started at ``incumbent`` (orders without pairs); with ``prove`` (see
    :func:`provable`) every backward is split and the solver's bound is returned."""
    from ortools.sat.python import cp_model

    tpl = problem.template
    R, M, S = tpl.num_ranks, tpl.num_microbatches, tpl.num_stages
    if any(a.type is ActionType.OVERLAP_F_B for row in incumbent.actions for a in row):
        return Outcome(None, None, False)
    chain = tpl.pipelines[0]
    nxt = {chain[k]: chain[k + 1] for k in range(len(chain) - 1)}
    values = [x for table in (problem.f, problem.b, problem.i, problem.w) for x in table]
    values += list(problem.fwd_delay + problem.bwd_delay)
    scale, exact = _scale(values)

    def ticks(x: float) -> int:
        return int(math.floor(x * scale + 1e-6))

    use_b = set() if prove else {a.stage for row in incumbent.actions for a in row if a.type is _B}
    horizon = ticks(sum(
        M * (problem.f[s] + (problem.b[s] if s in use_b else problem.i[s] + problem.w[s])) for s in range(S)
    ) + sum(problem.fwd_delay) * M + sum(problem.bwd_delay) * M) + 1
    # Any: recent ortools (9.15) types only its snake_case methods and sets the CamelCase ones used here (the only
    # ones in 9.8, the floor in pyproject.toml) at run time
    model: Any = cp_model.CpModel()
    start: dict[tuple[int, ActionType, int], cp_model.IntVar] = {}
    end: dict[tuple[int, ActionType, int], cp_model.IntVar] = {}
    per_rank: list[list[cp_model.IntervalVar]] = [[] for _ in range(R)]

    def add(s: int, kind: ActionType, mb: int, duration: float) -> None:
        d = ticks(duration)
        st = model.NewIntVar(0, horizon, f"s{s}{kind.value}{mb}")
        en = model.NewIntVar(0, horizon, f"e{s}{kind.value}{mb}")
        per_rank[tpl.stage_to_rank[s]].append(model.NewIntervalVar(st, d, en, f"i{s}{kind.value}{mb}"))
        start[(s, kind, mb)] = st
        end[(s, kind, mb)] = en

    for s in range(S):
        back = _B if s in use_b else _I
        for mb in range(M):
            add(s, _F, mb, problem.f[s])
            add(s, back, mb, problem.b[s] if back is _B else problem.i[s])
            if back is _I:
                add(s, _W, mb, problem.w[s])
    for r in range(R):
        model.AddNoOverlap(per_rank[r])
    for s in range(S):
        back = _B if s in use_b else _I
        n = nxt.get(s)
        for mb in range(M):
            if n is not None:
                model.Add(start[(n, _F, mb)] >= end[(s, _F, mb)] + ticks(problem.fwd_delay[s]))
                n_back = _B if n in use_b else _I
                model.Add(start[(s, back, mb)] >= end[(n, n_back, mb)] + ticks(problem.bwd_delay[s]))
            model.Add(start[(s, back, mb)] >= end[(s, _F, mb)])
            if back is _I:
                model.Add(start[(s, _W, mb)] >= end[(s, _I, mb)])
            if mb > 0:
                model.Add(start[(s, _F, mb)] >= end[(s, _F, mb - 1)])
                model.Add(start[(s, back, mb)] >= end[(s, back, mb - 1)])
    _add_memory(model, problem, use_b, start, end, horizon)
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, list(end.values()))
    model.Minimize(makespan)
    _hint(model, problem, incumbent, incumbent_starts, start, ticks)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    if deterministic_time is not None:  # stop on the solver's own work counter: the same answer on any machine
        solver.parameters.max_deterministic_time = deterministic_time
    status = solver.Solve(model)
    bound = None
    if prove and status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = solver.BestObjectiveBound() / scale
    optimal = prove and exact and status == cp_model.OPTIMAL
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Outcome(None, bound, False)
    rows: list[list[tuple[int, int, Action]]] = [[] for _ in range(R)]
    order = {_F: 0, _B: 1, _I: 1, _W: 2}
    for (s, kind, mb), var in start.items():
        rows[tpl.stage_to_rank[s]].append((solver.Value(var), order[kind], Action(s, kind, mb)))
    found = incumbent.with_actions([[a for _, _, a in sorted(row, key=lambda x: (x[0], x[1]))] for row in rows])
    return Outcome(found, bound, optimal)


def _add_memory(model, problem: Problem, use_b: set[int], start, end, horizon: int) -> None:  # type: ignore[no-untyped-def]
    """Per rank, each activation lives from its forward's start to its release, under the cap."""
    tpl = problem.template
    for r in range(tpl.num_ranks):
        if problem.cap[r] == math.inf:
            continue
        unit = max(problem.act) / 1000.0 if max(problem.act) > 1000 else 1.0  # keep demands small integers
        tasks, demands = [], []
        for s in tpl.stages_of(r):
            held_w = problem.act[s] - problem.freed_by_i[s]
            for mb in range(tpl.num_microbatches):
                if s in use_b:
                    parts = [(end[(s, _B, mb)], problem.act[s])]
                else:
                    parts = [(end[(s, _W, mb)], held_w), (end[(s, _I, mb)], problem.freed_by_i[s])]
                for release, amount in parts:
                    if amount <= 0:
                        continue
                    size = model.NewIntVar(0, horizon, "")
                    tasks.append(model.NewIntervalVar(start[(s, _F, mb)], size, release, ""))
                    demands.append(int(math.ceil(amount / unit)))
        model.AddCumulative(tasks, demands, int(math.floor(problem.cap[r] / unit + 1e-9)))


def _hint(model, problem: Problem, incumbent: Schedule, starts_of, start, ticks) -> None:  # type: ignore[no-untyped-def]
    """The incumbent's simulated start times (a B the model splits: its I at the B's start, its W right after)."""
    for rank, row in enumerate(incumbent.actions):
        for action, t in zip(row, starts_of[rank]):
            key = (action.stage, action.type, action.microbatch)
            if key in start:
                model.AddHint(start[key], ticks(t))
            elif action.type is _B:
                model.AddHint(start[(action.stage, _I, action.microbatch)], ticks(t))
                model.AddHint(start[(action.stage, _W, action.microbatch)], ticks(t + problem.i[action.stage]))
