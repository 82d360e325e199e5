"""Placement and phase helpers shared by the schedule modules (no schedule logic is copied between modules)."""

from __future__ import annotations

from ppsim.ir import Action, ActionType, Schedule

F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W


def loop_placement(num_ranks: int, num_stages_per_rank: int) -> tuple[int, ...]:
    """Stage s on rank s % R (Megatron interleaving, LoopedBFS, torch's default)."""
    return tuple(s % num_ranks for s in range(num_ranks * num_stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """V shape: rank r holds stages r and 2R-1-r."""
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


def make_schedule(
    name: str,
    actions: list[list[Action]],
    stage_to_rank: tuple[int, ...],
    num_microbatches: int,
    num_stages_per_rank: int,
    pipelines: tuple[tuple[int, ...], ...] = (),
) -> Schedule:
    return Schedule(
        name=name,
        actions=tuple(tuple(row) for row in actions),
        stage_to_rank=stage_to_rank,
        num_microbatches=num_microbatches,
        num_stages_per_rank=num_stages_per_rank,
        pipelines=pipelines,
    )
