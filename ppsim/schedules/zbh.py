"""ZB-H1 and ZB-H2: the handcrafted schedules of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024).

Both split each backward into I (gradient for the input, on the critical path) and W (gradient for the weights,
free to move). They keep 1F1B's shape and defer W: rank r runs the W of backward k right after backward k + lag.

- ZB-H1: 1F1B's R-1-r warm-up forwards, lag r. Every rank then holds R activations (1F1B's peak, reached on
  rank 0) and the bubble shrinks to (R-1)(F+I-W), a third of 1F1B's when F = I = W.
- ZB-H2: twice the warm-up, 2(R-1-r) forwards, lag 2r; 2R-1 activations per rank. With F = I = W and m >= 2R-1
  no rank ever idles between its first forward and its last W (the paper's parallelogram).
"""

from __future__ import annotations

from ppsim.ir import Action, Schedule
from ppsim.schedules import ScheduleSpec, register
from ppsim.schedules._phases import F, I, W, grouped, loop_schedule, one_f_one_b


def _build(name: str, num_ranks: int, num_microbatches: int, num_stages_per_rank: int, *, factor: int) -> Schedule:
    R, m = num_ranks, num_microbatches

    def rank_order(r: int, stage: range) -> list[Action]:
        # 1F1B's shape with `factor` times its warm-up; the W of backward k runs right after backward k + factor r.
        return one_f_one_b(
            grouped(stage, F, m, m),
            grouped(stage, I, m, m),
            num_warmup=factor * (R - 1 - r),
            weights=grouped(stage, W, m, m),
            weight_lag=factor * r,
        )

    return loop_schedule(name, R, m, num_stages_per_rank, rank_order)


def build_zbh1(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 1) -> Schedule:
    return _build("ZBH1", num_ranks, num_microbatches, num_stages_per_rank, factor=1)


def build_zbh2(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 1) -> Schedule:
    return _build("ZBH2", num_ranks, num_microbatches, num_stages_per_rank, factor=2)


register(
    ScheduleSpec(
        name="ZBH1",
        build=build_zbh1,
        description="zero-bubble H1 (ZB1P): 1F1B with backward split into I and W, W deferred to fill the tail; "
        "1F1B's peak memory, a third of its bubble",
        constraints="1 stage per rank; any microbatches (the bubble bound needs microbatches >= ranks)",
        fixed_stages_per_rank=1,
    )
)
register(
    ScheduleSpec(
        name="ZBH2",
        build=build_zbh2,
        description="zero-bubble H2 (ZB2P): twice 1F1B's warm-up and W deferred further; about twice 1F1B's "
        "memory, no bubble inside any rank's span when F = I = W",
        constraints="1 stage per rank; any microbatches (zero bubble needs microbatches >= 2 x ranks - 1)",
        fixed_stages_per_rank=1,
    )
)
