"""V-shape building blocks with controllable memory (Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS 2024): the stable pattern shared by V-Min and V-Half.

Every microbatch runs on each rank as one block of six unit slots: the forward of the first chunk (stage r), the
forward of the second chunk (stage 2R-1-r), the input backward of the second chunk, the input backward of the first
chunk, and the two weight backwards. Block k is block 0 shifted by 6k slots, so in the steady state every rank runs
one block per six slots with no idle slot when F = I = W. Where the four F/I slots of block 0 sit on rank r (its
*offsets*) decides how long each activation lives and so the peak memory: the lifespan of a block divided by the
period is the number of microbatches held at once. W fill the free slots, oldest first.

The order of each rank is its slots sorted by time; the simulator then runs every action as early as its inputs
allow, which squeezes out the idle slots of warm-up and cool-down.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ppsim.ir import Action, Schedule
from ppsim.schedules._phases import F, I, W, make_schedule, require_sizes, v_placement

PERIOD = 6


def pattern_schedule(
    name: str, num_ranks: int, num_microbatches: int, offsets: Sequence[tuple[int, int, int, int]]
) -> Schedule:
    """Lay out ``offsets[r] = (first-chunk F, second-chunk F, second-chunk I, first-chunk I)`` slot of block 0."""
    R, m = num_ranks, num_microbatches
    rows: list[list[Action]] = []
    for r in range(R):
        f0, f1, i1, i0 = offsets[r]
        assert len({x % PERIOD for x in offsets[r]}) == 4, f"{name}: slots of rank {r} collide"
        first, second = r, 2 * R - 1 - r
        slots: dict[int, Action] = {}
        for k in range(m):
            base = PERIOD * k
            slots[f0 + base] = Action(first, F, k)
            slots[f1 + base] = Action(second, F, k)
            slots[i1 + base] = Action(second, I, k)
            slots[i0 + base] = Action(first, I, k)
        # Walk the slots in time; each free slot runs the oldest pending W.
        pending: deque[Action] = deque()
        order: list[Action] = []
        for t in range(max(slots) + 1):
            action = slots.get(t)
            if action is not None:
                order.append(action)
                if action.type is I:
                    pending.append(Action(action.stage, W, action.microbatch))
            elif pending:
                order.append(pending.popleft())
        # Cool-down: the W still pending.
        order.extend(pending)
        rows.append(order)
    return make_schedule(name, rows, v_placement(R), m, 2)


def build_pattern(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_stages_per_rank: int,
    offsets: Sequence[tuple[int, int, int, int]],
) -> Schedule:
    require_sizes(name, num_ranks, num_microbatches, num_stages_per_rank, fixed_stages_per_rank=2)
    return pattern_schedule(name, num_ranks, num_microbatches, offsets)
