"""FSDP's exposed collectives in a pipeline's simulated step, as torchtitan 0.3.0 issues them under PP (FSDP2,
``reshard_after_forward`` False, gradient sync only in the last backward): each stage's parameters are all-gathered
before its first forward, and its gradients reduce-scattered after its last backward (a B, or the W of a split
backward). Both block the rank's compute stream there (gloo and torch's pipeline runtime issue them inline), so they
are added to those actions' durations (:func:`ppsim.simulate.simulate`'s ``extra_s``).

A ring collective over ``dp`` ranks moves ``(dp - 1)`` chunks of ``bytes / dp``: ``(dp - 1) * (alpha + bytes / dp /
beta)``, with ``alpha``/``beta`` from calibration (measured collective α/β when the profile has them, else its
point-to-point α/β, said in the notes)."""

from __future__ import annotations

from collections.abc import Sequence

from ppsim.ir import ActionType, Schedule


def ring_seconds(num_bytes: int, *, dp: int, alpha_s: float, bytes_per_s: float) -> float:
    """One ring all-gather or reduce-scatter of ``num_bytes`` (the unsharded size) over ``dp`` ranks."""
    if dp <= 1 or num_bytes <= 0:
        return 0.0
    return (dp - 1) * (alpha_s + num_bytes / dp / bytes_per_s)


def exposed_collectives(schedule: Schedule, *, gather_bytes: Sequence[int], reduce_bytes: Sequence[int], dp: int,
                        alpha_s: float, bytes_per_s: float) -> dict[tuple[int, int], float]:
    """(rank, position) -> seconds of FSDP collectives added there: stage ``s``'s all-gather of
    ``gather_bytes[s]`` on the action holding its first F, its reduce-scatter of ``reduce_bytes[s]`` on the action
    holding its last B or W."""
    out: dict[tuple[int, int], float] = {}
    if dp <= 1:
        return out
    for rank, row in enumerate(schedule.actions):
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for pos, action in enumerate(row):
            for comp in action.computations:
                if comp.type is ActionType.F:
                    first.setdefault(comp.stage, pos)
                elif comp.type in (ActionType.B, ActionType.W):
                    last[comp.stage] = pos
        for stage, pos in first.items():
            seconds = ring_seconds(gather_bytes[stage], dp=dp, alpha_s=alpha_s, bytes_per_s=bytes_per_s)
            out[(rank, pos)] = out.get((rank, pos), 0.0) + seconds
        for stage, pos in last.items():
            seconds = ring_seconds(reduce_bytes[stage], dp=dp, alpha_s=alpha_s, bytes_per_s=bytes_per_s)
            out[(rank, pos)] = out.get((rank, pos), 0.0) + seconds
    return out
