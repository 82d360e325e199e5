"""Interleaved 1F1B (Megatron's virtual pipeline, depth first): torch 2.13's ``ScheduleInterleaved1F1B``.

Rank r holds stages r, r+R, ... (loop placement). Microbatches go in rounds: a round's forwards run on the first
chunk, then the second, ...; backwards visit the chunks in reverse.
"""

from __future__ import annotations

from ppsim.ir import Action, Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import B, F, grouped, loop_schedule, one_f_one_b, round_size

NAME = "Interleaved1F1B"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    R, m, v = num_ranks, num_microbatches, num_stages_per_rank
    size = round_size(NAME, R, m)

    def rank_order(r: int, chunks: range) -> list[Action]:
        # Warm-up: every chunk but the last gets one round of forwards, plus two forwards per hop to the last rank.
        return one_f_one_b(
            grouped(chunks, F, m, size), grouped(chunks[::-1], B, m, size), num_warmup=(v - 1) * size + 2 * (R - 1 - r)
        )

    return loop_schedule(NAME, R, m, v, rank_order)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="Megatron's interleaved 1F1B: v stages per rank in loop placement, bubble / v "
        "(torch ScheduleInterleaved1F1B)",
        constraints="microbatches < 2 x ranks, or divisible by microbatches // ranks (any multiple of ranks "
        "is), as torch requires",
        default_stages_per_rank=2,
        min_stages_per_rank=1,
        torch_name="Interleaved1F1B",
    )
)
