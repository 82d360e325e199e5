"""Seeds: for V placement the controllable-memory building-block family at every memory level up to the cap, and
the greedy V construction (:mod:`ppsim.search.vgreedy`) at the highest level the cap allows, and the zero-bubble
authors' automatic V schedule (:mod:`ppsim.search.vauto`, their repeat-squeeze-reorder); for one stage per rank
the zero-bubble authors' greedy auto-scheduler (:mod:`ppsim.search.zbgreedy`) at the cap.

The paper's family (:func:`ppsim.schedules._vshape.building_blocks`: V-Min, V-Half and the blocks between and above
them, up to ZBV's memory) is built by the same repeat-squeeze-reorder as the named V-Min and V-Half. A block whose
repeated pattern holds more than the cap is skipped (the reordered schedule holds no more than the pattern); the
rest are tried from the most memory down (more memory, shorter schedule, as a rule), each simulated with the
search's costs and kept when it fits, while the phase's time lasts (ranking the blocks included), and only up to
:data:`MAX_SEED_RANKS` ranks. The named V schedules themselves are already the search's baseline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import chain

from ppsim.costs import StageCosts
from ppsim.ir import Schedule
from ppsim.result import SimResult
from ppsim.schedules._vshape import block_schedule, building_blocks, plain_peak
from ppsim.search.common import MemoryCap, fits, is_v
from ppsim.search.listsched import Problem

MAX_SEED_RANKS = 32
"""Beyond this many ranks the family (about 60 R blocks, each reordered in O(R M)) is not tried."""


def v_block_seeds(
    template: Schedule, costs: StageCosts, problem: Problem, cap: MemoryCap, *, deadline: float,
    max_count: int | None = None,
) -> Iterator[tuple[Schedule, SimResult]]:
    """Each building-block schedule that fits ``cap``, most memory first, until ``deadline`` or ``max_count``
    blocks are built (nothing for a placement other than V)."""
    from ppsim.simulator import simulate

    if not is_v(template) or template.num_ranks > MAX_SEED_RANKS:
        return
    R, M = template.num_ranks, template.num_microbatches
    limit = min(_count_limit(problem, cap), 2 * R)
    ranked = []
    for k, offsets in enumerate(building_blocks(R)):
        if time.perf_counter() >= deadline:
            break
        peak = plain_peak(offsets, M)
        if peak <= limit:
            ranked.append((-peak, k, offsets))
    ranked.sort()
    seen: set[tuple[object, ...]] = set()
    for count, (_, _, offsets) in enumerate(ranked):
        if time.perf_counter() >= deadline or (max_count is not None and count >= max_count):
            return
        schedule = block_schedule(R, M, offsets)
        if schedule.actions in seen:
            continue
        seen.add(schedule.actions)
        schedule = template.with_actions(schedule.actions)
        sim = simulate(schedule, costs)
        if fits(sim, cap):
            yield schedule, sim


def v_greedy_seeds(
    template: Schedule, costs: StageCosts, problem: Problem, cap: MemoryCap, *, deadline: float
) -> Iterator[tuple[Schedule, SimResult]]:
    """The greedy V orders (mean per-chunk F, I, W and hand-off delay of ``problem``) at each memory level from the
    cap's (at most ZBV's 2R) down, while ``deadline`` allows; those that fit. In practice the construction
    completes at 2R chunk activations, where it is often faster than ZBV with communication."""
    from ppsim.search.vgreedy import greedy_v
    from ppsim.simulator import simulate

    if not is_v(template) or template.num_ranks > MAX_SEED_RANKS:
        return
    R, M, S = template.num_ranks, template.num_microbatches, template.num_stages
    mean = (sum(problem.f) / S, sum(problem.i) / S, sum(problem.w) / S)
    delays = [d for d in problem.fwd_delay if d > 0]
    comm = sum(delays) / len(delays) if delays else 0.0
    top = int(min(_count_limit(problem, cap), 2 * R))
    for level in range(top, R - 1, -1):
        if time.perf_counter() >= deadline:
            return
        for schedule in greedy_v(R, M, mean, comm, level, deadline=deadline):
            schedule = template.with_actions(schedule.actions)
            sim = simulate(schedule, costs)
            if fits(sim, cap):
                yield schedule, sim


def v_auto_seeds(
    template: Schedule, costs: StageCosts, problem: Problem, cap: MemoryCap, *, deadline: float,
    max_count: int | None = None,
) -> Iterator[tuple[Schedule, SimResult]]:
    """The zero-bubble authors' automatic V schedule (:mod:`ppsim.search.vauto`): its orders, block by block, that
    fit ``cap``, until ``deadline``. The uniform blocks (``d0 = d1``) come first, most memory first (at R = 32,
    M = 64 and 128 at V-Half's level their best order is one of the first two); then the others in the authors'
    order; at most ``max_count`` blocks. V placement with ``M >= 2R`` only, up to :data:`MAX_SEED_RANKS` ranks."""
    from ppsim.errors import PPSimError
    from ppsim.search.vauto import block_orders, blocks, family, first_peak
    from ppsim.simulator import simulate

    R, M = template.num_ranks, template.num_microbatches
    if not is_v(template) or R > MAX_SEED_RANKS or M < 2 * R:
        return
    limit = min(_count_limit(problem, cap), 2 * R)
    ranked = []
    for k, (f1, b1, b0, d0, d1) in enumerate(family(R)):
        if d0 != d1:
            continue
        if time.perf_counter() >= deadline:
            return
        block = next(blocks(R, f1, b1, b0, d0, d1), None)
        if block is None:
            continue
        peak = first_peak(block, M)
        if peak <= limit:
            ranked.append((-peak, k, block))
    ranked.sort(key=lambda x: x[:2])
    runs = chain(([block] for _, _, block in ranked),
                 (blocks(R, *fam) for fam in family(R) if fam[3] != fam[4]))
    count = 0
    for group in runs:
        for block in group:  # more memory as n0 grows: stop at the first block above the cap
            if time.perf_counter() >= deadline or (max_count is not None and count >= max_count):
                return
            count += 1
            orders, peak = block_orders(block, M, limit)
            if peak > limit:
                break
            if orders is None:
                continue
            schedule = template.with_actions(orders)
            try:
                sim = simulate(schedule, costs)
            except PPSimError:
                continue
            if fits(sim, cap):
                yield schedule, sim


def loop_greedy_seeds(
    template: Schedule, costs: StageCosts, problem: Problem, cap: MemoryCap, *, deadline: float
) -> Iterator[tuple[Schedule, SimResult]]:
    """The zero-bubble authors' greedy auto-scheduler (:mod:`ppsim.search.zbgreedy`, 8 variants) at the cap, for
    one stage per rank; the orders that the simulator runs within the cap, until ``deadline``."""
    from ppsim.errors import PPSimError
    from ppsim.search.zbgreedy import zb_greedy_orders
    from ppsim.simulator import simulate

    for orders in zb_greedy_orders(problem):
        if time.perf_counter() >= deadline:
            return
        schedule = template.with_actions(orders)
        try:
            sim = simulate(schedule, costs)
        except PPSimError:  # an order that deadlocks (the greedy's own timing is not the judge)
            continue
        if fits(sim, cap):
            yield schedule, sim


def _count_limit(problem: Problem, cap: MemoryCap) -> float:
    """The most chunk activations a rank can hold under the cap (a count; with bytes, by the smallest activation)."""
    if cap.unit == "act":
        return cap.amount
    smallest = min(problem.act) if problem.act else 0.0
    return min(problem.cap) / smallest if smallest > 0 else float("inf")
