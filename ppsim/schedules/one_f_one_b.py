"""1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards; torch 2.13's ``Schedule1F1B``.

torch's ``pipeline_order`` for this schedule is wrong on the last rank (no forward of microbatch 0, a forward of
microbatch m); its execution path runs the order built here, which every other rank shares with torch.
"""

from __future__ import annotations

from ppsim.ir import Action, Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import B, F, grouped, loop_schedule, one_f_one_b

NAME = "1F1B"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 1) -> Schedule:
    R, m = num_ranks, num_microbatches

    def rank_order(r: int, stage: range) -> list[Action]:
        # Rank r runs R-1-r forwards before its first backward arrives (fewer when the batch is smaller).
        return one_f_one_b(grouped(stage, F, m, m), grouped(stage, B, m, m), num_warmup=R - 1 - r)

    return loop_schedule(NAME, R, m, num_stages_per_rank, rank_order)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="one forward, one backward: rank r holds at most R-r activations (torch Schedule1F1B)",
        constraints="1 stage per rank; any microbatches (torch: microbatches >= ranks)",
        fixed_stages_per_rank=1,
        torch_name="1F1B",
    )
)
