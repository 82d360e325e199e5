"""Local search on an order: single actions moved within their rank's order, each candidate re-simulated by
:func:`ppsim.simulate` (the judge), kept when the makespan drops and every rank still fits the cap."""

from __future__ import annotations

import random
import time
from typing import Callable

from ppsim.costs import CostModel
from ppsim.errors import PPSimError
from ppsim.ir import Schedule
from ppsim.result import SimResult
from ppsim.search.common import MemoryCap, fits


def _score(sim: SimResult) -> tuple[float, float]:
    """Makespan first; then the sum of the ranks' finishing times, which rewards progress off the critical rank."""
    return sim.makespan, sum(max(ends, default=0.0) for ends in sim.ends)


def local_search(
    schedule: Schedule,
    costs: CostModel,
    cap: MemoryCap,
    rng: random.Random,
    deadline: float,
    report: Callable[[str], None],
    max_tries: int | None = None,
) -> tuple[Schedule, int]:
    """First-improvement local search: move one action a few places earlier or later in its rank's order.

    A move is kept when it lowers the makespan, or keeps it and lowers the sum of the ranks' finishing times."""
    from ppsim.simulate import simulate

    current = schedule
    cur = _score(simulate(current, costs))
    n = 0
    failures = 0
    while time.perf_counter() < deadline and failures < 3000 and (max_tries is None or n < max_tries):
        report("local search")  # rate-limited by the caller: a line every half second
        rows = [list(r) for r in current.actions]
        r = rng.randrange(len(rows))
        if not rows[r]:
            failures += 1
            continue
        i = rng.randrange(len(rows[r]))
        step = rng.choice((-3, -2, -1, 1, 2, 3))
        j = i + step
        if not 0 <= j < len(rows[r]):
            failures += 1
            continue
        a = rows[r].pop(i)
        rows[r].insert(j, a)
        cand = current.with_actions(rows)
        n += 1
        try:
            csim = simulate(cand, costs)
        except PPSimError:  # a move that deadlocks (DeadlockError) or breaks the order
            failures += 1
            continue
        score = _score(csim)
        better = score[0] < cur[0] - 1e-9 or (score[0] <= cur[0] + 1e-9 and score[1] < cur[1] - 1e-9)
        if better and fits(csim, cap):
            if score[0] < cur[0] - 1e-9:
                report("local search")
                failures = 0
            current, cur = cand, score
        else:
            failures += 1
    return current, n
