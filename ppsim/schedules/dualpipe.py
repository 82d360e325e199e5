"""DualPipe: DeepSeek's bidirectional schedule (two model copies, microbatches fed from both ends).

Direction 0 is stages 0..R-1 on ranks 0..R-1; direction 1 is a second copy whose j-th stage is numbered R+j and sits
on rank R-1-j. Each half of the ranks runs DeepSeek's eight phases (:mod:`ppsim.schedules._dualpipe_phases`) as a V
of R/2 ranks with M/2 microbatches, at position h = min(r, R-1-r): on the first half the V's first stage is
direction 0's, on the second half direction 1's (the phase order swapped), so the two middle ranks are the V's tip.
"""

from __future__ import annotations

from ppsim.ir import Schedule, require
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._dualpipe_phases import dualpipe_rank_actions
from ppsim.schedules._phases import make_schedule, v_placement

NAME = "DualPipe"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    R, M = num_ranks, num_microbatches
    require(
        R % 2 == 0,
        f"--ranks {R}: {NAME} mirrors two halves of the ranks, so needs an even number; pass -r {R + 1}",
    )
    require(
        M % 2 == 0,
        f"--mb {M}: {NAME} feeds half the microbatches from each end, so needs an even number; "
        f"pass -m {max(M + 1, 2 * R)}",
    )
    require(
        M >= 2 * R,
        f"--mb {M}: {NAME} with {R} ranks needs at least 2 x ranks = {2 * R} microbatches; pass -m {2 * R} or more",
    )
    actions = []
    for r in range(R):
        # the V's first stage is the direction fed from this half's outer end: 0 on the first half, 1 on the second
        own, mirrored = (r, 2 * R - 1 - r) if r < R // 2 else (2 * R - 1 - r, r)
        actions.append(
            dualpipe_rank_actions(
                min(r, R - 1 - r),
                num_half_ranks=R // 2,
                num_microbatches=M // 2,
                first_stage=own,
                second_stage=mirrored,
            )
        )
    pipelines = (tuple(range(R)), tuple(range(R, 2 * R)))
    return make_schedule(NAME, actions, v_placement(R), M, num_stages_per_rank, pipelines)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="DeepSeek's bidirectional DualPipe: two model copies fed from both ends, overlapped "
        "forward/backward pairs (not runnable by torch's runtime)",
        constraints="2 stages per rank (two model copies); even ranks; even microbatches >= 2 x ranks",
        fixed_stages_per_rank=2,
    )
)
