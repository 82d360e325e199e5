"""GPipe (alias AFAB, all forwards then all backwards): one stage per rank; torch 2.13's ``ScheduleGPipe``."""

from __future__ import annotations

from ppsim.ir import Action, Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import B, F, grouped, loop_schedule, one_f_one_b

NAME = "GPipe"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 1) -> Schedule:
    m = num_microbatches

    def rank_order(r: int, stage: range) -> list[Action]:
        # A warm-up as long as the batch: every forward, then every backward (both in microbatch order).
        return one_f_one_b(grouped(stage, F, m, m), grouped(stage, B, m, m), num_warmup=m)

    return loop_schedule(NAME, num_ranks, m, num_stages_per_rank, rank_order)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="fill-drain: all forwards, then all backwards; holds every microbatch's activations "
        "(torch ScheduleGPipe)",
        constraints="1 stage per rank; any ranks and microbatches",
        fixed_stages_per_rank=1,
        aliases=("AFAB",),
        torch_name="GPipe",
    )
)
