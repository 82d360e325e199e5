"""ZBV: the zero-bubble paper's V schedule (rank r holds stages r and 2R-1-r), torch 2.13's ``ScheduleZBVZeroBubble``.

Every backward is split into I and W. The order is laid out for at least 2R-1 microbatches; with fewer, the actions
of the missing microbatches are dropped (as torch does).
"""

from __future__ import annotations

from ppsim.ir import Action, ActionType, Schedule, make_action
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import F, I, W, make_schedule, v_placement

NAME = "ZBVZeroBubble"


def _rank_actions(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    R, r, m = num_ranks, rank, num_microbatches
    n = max(2 * R - 1, m)
    s0, s1 = r, 2 * R - 1 - r
    out: list[Action] = []

    def add(stage: int, kind: ActionType, mb: int) -> None:
        if mb < m:
            out.append(make_action(stage, kind, mb))

    f0 = 2 * R - r - 1  # first-stage forwards in warm-up
    # Warm-up 1: first-stage forwards.
    for k in range(2 * (R - r) - 1):
        add(s0, F, k)
    # Warm-up 2: second- and first-stage forwards alternate.
    for k in range(r):
        add(s1, F, k)
        add(s0, F, 2 * (R - r) - 1 + k)
    # Warm-up 3: second-stage forward, then its I and W at once.
    for k in range(R - r):
        add(s1, F, r + k)
        add(s1, I, k)
        add(s1, W, k)
    # Steady: [first-stage forward while any remain], F I W per stage, one microbatch each.
    for k in range(n - R):
        if f0 + k < n:
            add(s0, F, f0 + k)
        add(s0, I, k)
        add(s0, W, k)
        add(s1, F, R + k)
        add(s1, I, R - r + k)
        add(s1, W, R - r + k)
    # Cool-down 1: input backwards of both stages, weights deferred.
    for k in range(r):
        add(s0, I, n - R + k)
        add(s1, I, n - r + k)
    # Cool-down 2: first-stage I, each followed by the oldest deferred first-stage W.
    for k in range(R - r):
        add(s0, I, n - R + r + k)
        add(s0, W, n - R + k)
    # Drain: remaining second-stage weights, then first-stage weights.
    for k in range(n - r, n):
        add(s1, W, k)
    for k in range(n - r, n):
        add(s0, W, k)
    return out


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    actions = [_rank_actions(r, num_ranks, num_microbatches) for r in range(num_ranks)]
    return make_schedule(NAME, actions, v_placement(num_ranks), num_microbatches, num_stages_per_rank)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="Zero-bubble V schedule (ZB-V): backwards split into I and W, W fills the bubbles "
        "(torch ScheduleZBVZeroBubble)",
        constraints="2 stages per rank (V: rank r holds r and 2R-1-r); any number of microbatches",
        fixed_stages_per_rank=2,
        torch_name="ZBVZeroBubble",
    )
)
