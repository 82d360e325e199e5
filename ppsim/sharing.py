"""Local processes sharing a host's cores: each computation slowed by how many compute beside it.

``ppsim run`` on one CPU host starts ``pp x per_rank`` processes (a PP rank's FSDP/TP processes compute in lockstep),
one thread each. While more of them compute than the host has cores, each gets ``cores / computing`` of a core;
while a PP rank waits (its bubble), the others have its cores. A profile measures computations with one process per
PP rank and no more than the cores, so its costs hold when few compute at once and stretch when many do.

:func:`shared_cores_step` models this as processor sharing over the simulated timeline, by a fixed point: simulate,
give each computation the time-average of ``max(1, computing / cores)`` over its span, stretch it by that factor,
simulate again (a few rounds, each factor after the first averaged with the previous one so the rounds settle).
Collectives and other non-computations are left as they are. No number is fitted: the cores are the host's, the
timeline is the simulator's.

Where each PP rank has several processes (FSDP or TP peers) and they all outnumber the cores, ``ppsim run`` pins
them by replica (:func:`core_plan`): the processes at the same FSDP/TP position of every PP rank (one copy of the
pipeline) share cores of their own, so a rank's bubble still lends its core to the other ranks of its pipeline,
and the copies, doing the same work on the same share of cores, reach their collectives together. Unpinned, the OS
lets one copy run ahead, and the one ahead waits for the other at every reduce-scatter: on a pp 2 x dp_shard 2
LoopedBFS step on 2 cores one peer's ``REDUCE_GRAD`` took 13-28 ms and the other's 60-220 ms, idle time no model of
a fair share has. Pinning each PP rank to cores of its own instead (no lending) made the same steps 20-50 % slower.
Pinned by replica, the sharing model is unchanged: each copy's ranks share its cores (:func:`sharing`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ppsim.ir import ActionType, Schedule
from ppsim.result import SimResult

COMPUTE = frozenset({ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B})
ROUNDS = 6


def shared_cores_step(schedule: Schedule, simulate_with: Callable[[Mapping[tuple[int, int], float]], SimResult], *,
                      per_rank: int, cores: int, extra_s: Mapping[tuple[int, int], float] | None = None,
                      rounds: int = ROUNDS) -> tuple[SimResult, dict[tuple[int, int], float]]:
    """The step of ``schedule`` when its ranks' ``per_rank`` processes share ``cores`` cores (pinned by copy of the
    pipeline where ``ppsim run`` pins them, :func:`core_plan`), and the seconds
    added per (rank, position) (``extra_s`` plus each computation's stretch). ``simulate_with(extra)`` simulates the
    schedule with ``extra`` seconds added at (rank, position)."""
    base_extra = dict(extra_s or {})
    result = simulate_with(base_extra)
    if schedule.num_ranks * per_rank <= cores:
        return result, base_extra
    base = {key: result.ends[key[0]][key[1]] - result.starts[key[0]][key[1]] - base_extra.get(key, 0.0)
            for key in _computations(schedule)}
    factor = dict.fromkeys(base, 1.0)
    extra = base_extra
    copies, copy_cores = sharing(per_rank, cores, schedule.num_ranks)
    for step in range(rounds):
        seen = _factors(schedule, result, per_rank=copies, cores=copy_cores)
        factor = {key: (factor[key] + seen[key]) / 2 if step else seen[key] for key in base}
        extra = dict(base_extra)
        for key, seconds in base.items():
            extra[key] = extra.get(key, 0.0) + seconds * (factor[key] - 1.0)
        result = simulate_with(extra)
    return result, extra


def _computations(schedule: Schedule) -> list[tuple[int, int]]:
    return [(r, p) for r, row in enumerate(schedule.actions) for p, a in enumerate(row) if a.type in COMPUTE]


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_plan(pp: int, per_rank: int, cores: int) -> tuple[tuple[int, ...], ...] | None:
    """Per FSDP/TP position within a PP rank (``0..per_rank-1``, one copy of the pipeline each), the indices
    (``0..cores-1``) of the cores ``ppsim run`` pins its processes to, or ``None`` (not pinned: one process per PP
    rank, or no more processes than cores). Each copy gets ``cores // per_rank`` cores or one more; with fewer cores
    than copies, copy ``j`` shares core ``j * cores // per_rank``."""
    if per_rank <= 1 or pp * per_rank <= cores:
        return None
    if per_rank <= cores:
        return tuple(tuple(range(j * cores // per_rank, (j + 1) * cores // per_rank)) for j in range(per_rank))
    return tuple((j * cores // per_rank,) for j in range(per_rank))


def sharing(per_rank: int, cores: int, pp: int) -> tuple[int, int]:
    """``(copies, cores)`` of the most crowded core set: the copies of the pipeline whose ranks compute on those
    cores. Unpinned, all ``per_rank`` copies on all cores; pinned (:func:`core_plan`), the copies on the set with
    the most copies per core (the one the collectives wait for)."""
    plan = core_plan(pp, per_rank, cores)
    if plan is None:
        return per_rank, cores
    counts: dict[tuple[int, ...], int] = {}
    for mine in plan:
        counts[mine] = counts.get(mine, 0) + 1
    mine = max(counts, key=lambda c: counts[c] / len(c))
    return counts[mine], len(mine)


def _factors(schedule: Schedule, result: SimResult, *, per_rank: int, cores: int) -> dict[tuple[int, int], float]:
    """Per computation, the time-average of ``max(1, computing processes / cores)`` over its span."""
    spans = {key: (result.starts[key[0]][key[1]], result.ends[key[0]][key[1]]) for key in _computations(schedule)}
    events: list[tuple[float, int]] = []
    for start, end in spans.values():
        if end > start:
            events += [(start, per_rank), (end, -per_rank)]
    events.sort()
    # the piecewise-constant count of computing processes: (from, to, count)
    pieces: list[tuple[float, float, int]] = []
    count, last = 0, None
    for t, delta in events:
        if last is not None and t > last and count:
            pieces.append((last, t, count))
        count += delta
        last = t
    out: dict[tuple[int, int], float] = {}
    for key, (start, end) in spans.items():
        if end <= start:
            out[key] = 1.0
            continue
        weighted = sum((min(b, end) - max(a, start)) * max(1.0, n / cores)
                       for a, b, n in pieces if b > start and a < end)
        out[key] = weighted / (end - start)
    return out
