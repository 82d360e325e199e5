"""Local search on an order: single actions moved within their rank's order, each candidate re-simulated by
:func:`ppsim.simulator` (the judge), kept when the makespan drops and every rank still fits the cap.

Half of the moves are drawn anywhere; the other half move an action of the *critical chain* (the chain of
computations, each started by its rank's previous one or by its input, that ends at the makespan) ahead of the
rank-mate that delayed it, each such move tried once until one is kept and the chain is walked again. On a big
order (R=32, M=128: 24,576 computations) random moves almost never touch the chain; these do (1017.6 -> 1016.6 in
a 60 s search there, F=1, I=1.5, W=0.5, comm 0.1, 34act)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from ppsim import deps
from ppsim.costs import StageCosts
from ppsim.errors import PPSimError
from ppsim.ir import Schedule
from ppsim.result import SimResult
from ppsim.search.common import MemoryCap, fits


def _score(sim: SimResult) -> tuple[float, float]:
    """Makespan first; then the sum of the ranks' finishing times, which rewards progress off the critical rank."""
    return sim.makespan, sum(max(ends, default=0.0) for ends in sim.ends)


def critical_chain(schedule: Schedule, sim: SimResult) -> list[tuple[int, int]]:
    """The (rank, index) of every action on the critical chain that its rank's previous action delayed (it started
    the moment that one ended): moving it earlier in its rank's order is the move that can shorten the chain."""
    producer: dict[deps.Key, tuple[int, int]] = {}
    for r, row in enumerate(schedule.actions):
        for k, action in enumerate(row):
            for comp in action.computations:
                for key in deps.provides(comp):
                    producer[key] = (r, k)
    ends = sim.ends
    r = max(range(len(ends)), key=lambda x: max(ends[x], default=0.0))
    k = len(ends[r]) - 1
    out: list[tuple[int, int]] = []
    while k >= 0:
        start = sim.starts[r][k]
        if k > 0 and abs(ends[r][k - 1] - start) <= 1e-9:
            out.append((r, k))
            k -= 1
            continue
        # started by an input: follow the latest-ending one to its rank
        sources = [producer[key] for comp in schedule.actions[r][k].computations
                   for key in deps.requires(schedule, comp) if key in producer]
        if not sources:
            break
        r, k = max(sources, key=lambda x: ends[x[0]][x[1]])
    return out


def local_search(
    schedule: Schedule,
    costs: StageCosts,
    cap: MemoryCap,
    rng: random.Random,
    deadline: float,
    report: Callable[[str], None],
    max_tries: int | None = None,
    *,
    chain_share: float = 0.5,
) -> tuple[Schedule, int]:
    """First-improvement local search: move one action a few places earlier or later in its rank's order.

    A move is kept when it lowers the makespan, or keeps it and lowers the sum of the ranks' finishing times.
    ``chain_share`` of the moves are critical-chain moves (see the module docstring)."""
    from ppsim.simulator import simulate

    current = schedule
    cur_sim = simulate(current, costs)
    cur = _score(cur_sim)
    chain: list[tuple[int, int, int]] | None = None  # the chain moves not tried yet: (rank, index, step)
    n = 0
    failures = 0
    while time.perf_counter() < deadline and failures < 3000 and (max_tries is None or n < max_tries):
        report("local search")  # rate-limited by the caller: a line every half second
        rows = [list(r) for r in current.actions]
        if chain is None:  # each chain move once per chain: one place earlier for every action, then two, three
            links = critical_chain(current, cur_sim)
            chain = [(r, k, -step) for step in (1, 2, 3) for r, k in links]
        if chain and rng.random() < chain_share:  # an action of the critical chain, ahead of the one that delayed it
            r, i, step = chain.pop(0)
        else:
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
            current, cur, cur_sim, chain = cand, score, csim, None
        else:
            failures += 1
    return current, n
