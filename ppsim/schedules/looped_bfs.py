"""Looped BFS (breadth-first pipeline, Lamy-Poirier 2022): torch 2.13's ``ScheduleLoopedBFS``.

Rank r holds stages r, r+R, ... (loop placement) and runs each chunk for the whole batch before the next.
"""

from __future__ import annotations

from ppsim.ir import Action, Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import B, F, grouped, loop_schedule, one_f_one_b

NAME = "LoopedBFS"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    m = num_microbatches

    def rank_order(r: int, chunks: range) -> list[Action]:
        forwards = grouped(chunks, F, m, m)
        # All forwards chunk by chunk, then all backwards exactly reversed (last chunk, last microbatch first).
        return one_f_one_b(forwards, grouped(chunks, B, m, m)[::-1], num_warmup=len(forwards))

    return loop_schedule(NAME, num_ranks, m, num_stages_per_rank, rank_order)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="breadth first: each chunk runs the whole batch forward before the next, backwards in reverse; "
        "v stages per rank in loop placement (torch ScheduleLoopedBFS)",
        constraints="any ranks and microbatches",
        default_stages_per_rank=2,
        min_stages_per_rank=1,
        torch_name="LoopedBFS",
    )
)
