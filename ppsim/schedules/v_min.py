"""V-Min: the controllable-memory V schedule with the least activation memory (Qi et al. 2024).

Each rank holds (R + 4) // 3 microbatches' activations at most (2 chunks each), about a third of 1F1B's R; with
F = I = W its bubble rate is about 2R / (3m). Built from the block below like V-Half (repeat, then reorder the warm-up
and cool-down at the same peak; see :mod:`ppsim.schedules._vshape`).
"""

from __future__ import annotations

from ppsim.ir import Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._vshape import build_pattern

NAME = "V-Min"


def offsets(num_ranks: int, rank: int) -> tuple[int, int, int, int]:
    """Block-0 slots of rank r: forwards one slot apart down and back up the V, backwards likewise.

    A gap of 2 slots between the two halves when 3 divides R keeps the four slots distinct modulo 6."""
    R, r = num_ranks, rank
    gap = 2 if R % 3 == 0 else 0
    return (r, 2 * R - 1 - r, 2 * R + gap + r, 4 * R + gap - 1 - r)


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    table = [offsets(num_ranks, r) for r in range(num_ranks)]
    return build_pattern(NAME, num_ranks, num_microbatches, num_stages_per_rank, table)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="controllable-memory V schedule (Qi et al. 2024), least memory: (R+4)//3 microbatches' "
        "activations per rank, about 1/3 of 1F1B, bubble rate about 2R/(3m) when F = I = W",
        constraints="2 stages per rank (V: rank r holds r and 2R-1-r); any number of microbatches",
        fixed_stages_per_rank=2,
        aliases=("VMin",),
    )
)
