"""GPipe (alias AFAB, all forwards then all backwards): one stage per rank; torch 2.13's ``ScheduleGPipe``."""

from __future__ import annotations

from ppsim.ir import Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import (
    B,
    F,
    grouped,
    loop_placement,
    make_schedule,
    one_f_one_b,
    require_sizes,
)

NAME = "GPipe"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 1) -> Schedule:
    R, m = num_ranks, num_microbatches
    require_sizes(NAME, R, m, num_stages_per_rank, fixed_stages_per_rank=1)
    # A warm-up as long as the batch: every forward, then every backward (both in microbatch order).
    actions = [one_f_one_b(grouped([r], F, m, m), grouped([r], B, m, m), num_warmup=m) for r in range(R)]
    return make_schedule(NAME, actions, loop_placement(R, 1), m, 1)


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
