"""Interleaved zero bubble (the paper's ZB1P on a virtual pipeline): torch 2.13's ``ScheduleInterleavedZeroBubble``.

Interleaved 1F1B's rounds and loop placement with each backward split into I and W; warm-up is one forward per
hop instead of two, and rank r runs the W of backward k right after backward k + r. With one stage per rank this
is ZB-H1.
"""

from __future__ import annotations

from ppsim.ir import Action, Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import F, I, W, grouped, loop_schedule, one_f_one_b, round_size

NAME = "InterleavedZeroBubble"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    R, m, v = num_ranks, num_microbatches, num_stages_per_rank
    size = round_size(NAME, R, m)

    def rank_order(r: int, chunks: range) -> list[Action]:
        # Warm-up: one round per chunk but the last, plus one forward per hop; W trails its I by r backwards.
        return one_f_one_b(
            grouped(chunks, F, m, size),
            grouped(chunks[::-1], I, m, size),
            num_warmup=(v - 1) * size + (R - 1 - r),
            weights=grouped(chunks[::-1], W, m, size),
            weight_lag=r,
        )

    return loop_schedule(NAME, R, m, v, rank_order)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="interleaved 1F1B with backward split into I and W, W deferred into the bubbles "
        "(torch ScheduleInterleavedZeroBubble)",
        constraints="microbatches < 2 x ranks, or divisible by microbatches // ranks (any multiple of ranks "
        "is), as torch requires",
        default_stages_per_rank=2,
        min_stages_per_rank=1,
        torch_name="InterleavedZeroBubble",
    )
)
