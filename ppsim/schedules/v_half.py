"""V-Half: the controllable-memory V schedule with half of 1F1B's activation memory (Qi et al. 2024).

Each rank holds (R + 2) // 2 microbatches' activations at most (2 chunks each), about half of 1F1B's R; with
F = I = W its bubble rate is about R / (2m). Built as the paper and its authors build it: the building block below,
repeated, then the warm-up and cool-down reordered at the same peak (see :mod:`ppsim.schedules._vshape`). With
F = I = W = 1, B = 2, comm 0.1 it takes 55.2 on 4 ranks x 8 microbatches and 117.8 on 8 x 16, the authors' makespans.
"""

from __future__ import annotations

from ppsim.ir import Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._vshape import build_pattern

NAME = "V-Half"


def offsets(num_ranks: int, rank: int) -> tuple[int, int, int, int]:
    """Block-0 slots of rank r: first-chunk forwards two slots apart (room for the backward travelling the other
    way), the rest one slot apart; a gap of 3 slots when R is even keeps the four slots distinct modulo 6."""
    R, r = num_ranks, rank
    gap = 3 if R % 2 == 0 else 0
    return (2 * r, 3 * R - r - 2, 3 * R + gap + 2 * r - 1, 6 * R + gap - r - 2)


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    table = [offsets(num_ranks, r) for r in range(num_ranks)]
    return build_pattern(NAME, num_ranks, num_microbatches, num_stages_per_rank, table)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="controllable-memory V schedule (Qi et al. 2024), half memory: (R+2)//2 microbatches' "
        "activations per rank, about 1/2 of 1F1B, bubble rate about R/(2m) when F = I = W",
        constraints="2 stages per rank (V: rank r holds r and 2R-1-r); any number of microbatches",
        fixed_stages_per_rank=2,
        aliases=("VHalf",),
    )
)
