"""Placement and phase helpers shared by the schedule modules (no schedule logic is copied between modules).

The 1F1B family (GPipe, 1F1B, ZB-H1, ZB-H2, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) differs only in
which forwards and backwards a rank runs, in what order, and how many forwards it runs before its first
backward. Each module writes one rank's order with :func:`one_f_one_b` (the one place the phases are laid out) and
hands it to :func:`loop_schedule` (loop placement, one call per rank). Sizes (ranks, microbatches, stages per rank)
are checked once, by the registry, before any builder runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ppsim.errors import ScheduleConfigError
from ppsim.ir import Action, ActionType, Schedule, make_action, require

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


def loop_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_stages_per_rank: int,
    rank_order: Callable[[int, range], list[Action]],
) -> Schedule:
    """A schedule in loop placement: ``rank_order(rank, stages of the rank, first chunk first)`` per rank."""
    actions = [rank_order(r, rank_stages(r, num_ranks, num_stages_per_rank)) for r in range(num_ranks)]
    placement = loop_placement(num_ranks, num_stages_per_rank)
    return make_schedule(name, actions, placement, num_microbatches, num_stages_per_rank)


def require_sizes(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_stages_per_rank: int,
    *,
    fixed_stages_per_rank: int | None = None,
) -> None:
    """Refuse counts no schedule can use, and a stages-per-rank the schedule's placement does not allow.

    Registered builders need not call this: the registry checks sizes before building
    (:func:`ppsim.schedules.checked_sizes`); it stays for builders used outside the registry."""
    require(num_ranks >= 1, f"--ranks {num_ranks}: {name} needs at least 1 rank; pass -r 1 or more")
    require(
        num_microbatches >= 1, f"--mb {num_microbatches}: {name} needs at least 1 microbatch; pass -m 1 or more"
    )
    if fixed_stages_per_rank is not None:
        require(
            num_stages_per_rank == fixed_stages_per_rank,
            f"--stages-per-rank {num_stages_per_rank}: {name} always places {fixed_stages_per_rank} stage(s) per "
            f"rank; drop -v or pass -v {fixed_stages_per_rank}",
        )
    require(
        num_stages_per_rank >= 1,
        f"--stages-per-rank {num_stages_per_rank}: {name} needs at least 1 stage per rank; pass -v 1 or more",
    )


def rank_stages(rank: int, num_ranks: int, num_stages_per_rank: int) -> range:
    """The stages ``rank`` holds under :func:`loop_placement`, first chunk first."""
    return range(rank, num_ranks * num_stages_per_rank, num_ranks)


def round_size(name: str, num_ranks: int, num_microbatches: int) -> int:
    """Microbatches per round of an interleaved schedule, counted as torch 2.13 counts them.

    torch runs ``max(1, m // R)`` rounds of equal size: any m < 2R is one round of m microbatches, and m >= 2R
    must split evenly into ``m // R`` rounds (m = 10 on 4 ranks is 2 rounds of 5; m = 7 on 2 ranks is refused).
    """

    def splits(m: int) -> bool:
        return m % max(1, m // num_ranks) == 0

    if not splits(num_microbatches):
        nearest = min(
            (k for k in range(1, num_microbatches + num_ranks) if splits(k)),
            key=lambda k: (abs(k - num_microbatches), k),
        )
        raise ScheduleConfigError(
            f"--mb {num_microbatches}: {name} on {num_ranks} ranks runs microbatches // ranks = "
            f"{num_microbatches // num_ranks} equal rounds and {num_microbatches} does not split into them; "
            f"pass e.g. -m {nearest} (any multiple of {num_ranks} works)"
        )
    return num_microbatches // max(1, num_microbatches // num_ranks)


def grouped(stages: Sequence[int], kind: ActionType, num_microbatches: int, group_size: int) -> list[Action]:
    """``kind`` actions of every microbatch on each of ``stages``, in rounds of ``group_size`` microbatches.

    Round g runs microbatches ``g*group_size ...`` on ``stages[0]``, then the same ones on ``stages[1]``, and so on:
    ``grouped([1, 5], F, 4, 2)`` is ``1F0 1F1 5F0 5F1 1F2 1F3 5F2 5F3``. With one stage, or one round, it is simply
    every microbatch on each stage in turn.
    """
    return [
        make_action(s, kind, mb)
        for start in range(0, num_microbatches, group_size)
        for s in stages
        for mb in range(start, min(start + group_size, num_microbatches))
    ]


def one_f_one_b(
    forwards: Sequence[Action],
    backwards: Sequence[Action],
    *,
    num_warmup: int,
    weights: Sequence[Action] = (),
    weight_lag: int = 0,
) -> list[Action]:
    """One rank's order: warm-up forwards, then one forward and one backward at a time, then the backwards left.

    ``forwards`` and ``backwards`` are the rank's forwards and its backwards (``B``, or ``I`` when ``weights`` is
    given) each in the order they run; the steady phase pairs forward ``num_warmup + k`` with backward ``k``.
    ``num_warmup = len(forwards)`` gives all forwards, then all backwards (GPipe, LoopedBFS).
    ``weights`` are the rank's ``W`` in the order of its ``I``: the W of backward ``k`` runs right after backward
    ``k + weight_lag``, and the last ``weight_lag`` W fill the tail (zero-bubble schedules).
    """
    num = len(forwards)
    assert len(backwards) == num and (not weights or len(weights) == num), "one backward (and W) per forward"
    warm = min(num_warmup, num)
    steady = num - warm
    lag = weight_lag if weights else num
    # Step 1: warm-up, forwards only
    order = list(forwards[:warm])
    # Step 2: steady state, 1F1B: forward warm + k with backward k (plus the W of backward k - lag once k >= lag);
    # the phases are laid out by slice assignment, one interleaving per stretch
    plain = min(lag, steady)
    order += _interleave(forwards[warm : warm + plain], backwards[:plain])
    order += _interleave(
        forwards[warm + plain :], backwards[plain:steady], weights[max(plain - lag, 0) : max(steady - lag, 0)]
    )
    # Step 3: cool-down, the backwards left (plus lagged W)
    first_w = max(steady, lag)
    order += backwards[steady:first_w]
    order += _interleave(backwards[first_w:], weights[max(first_w - lag, 0) : max(num - lag, 0)])
    # Step 4: the W still pending
    order += weights[max(num - lag, 0) :]
    return order


def _interleave(*parts: Sequence[Action]) -> list[Action]:
    """``a0 b0 c0 a1 b1 c1 ...`` from equally long ``a, b, c`` (C-speed slice assignment)."""
    width, count = len(parts), len(parts[0])
    assert all(len(p) == count for p in parts), "stretches of equal length"
    out: list[Action] = [None] * (width * count)  # type: ignore[list-item]
    for k, part in enumerate(parts):
        out[k::width] = part
    return out
