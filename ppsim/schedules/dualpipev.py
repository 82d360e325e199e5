"""DualPipeV: DeepSeek's DualPipe folded onto one V (rank r holds stages r and 2R-1-r).

The per-rank program is DeepSeek's eight phases (:mod:`ppsim.schedules._dualpipe_phases`); its compute order equals
torch 2.13's ``ScheduleDualPipeV``.
"""

from __future__ import annotations

from ppsim.ir import Schedule, require
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._dualpipe_phases import dualpipe_rank_actions
from ppsim.schedules._phases import make_schedule, v_placement

NAME = "DualPipeV"


def build(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    R, m = num_ranks, num_microbatches
    require(
        m >= 2 * R,
        f"--mb {m}: {NAME} with {R} ranks needs at least as many microbatches as stages ({2 * R}); "
        f"pass -m {2 * R} or more",
    )
    actions = [
        dualpipe_rank_actions(r, num_half_ranks=R, num_microbatches=m, first_stage=r, second_stage=2 * R - 1 - r)
        for r in range(R)
    ]
    return make_schedule(NAME, actions, v_placement(R), m, num_stages_per_rank)


register(
    ScheduleSpec(
        name=NAME,
        build=build,
        description="DeepSeek's DualPipe on one V: overlapped forward/backward pairs, zero-bubble W in warm-up and "
        "cool-down (torch ScheduleDualPipeV)",
        constraints="2 stages per rank (V: rank r holds r and 2R-1-r); microbatches >= 2 x ranks",
        fixed_stages_per_rank=2,
        torch_name="DualPipeV",
    )
)
