"""Local processes sharing a host's cores: each computation slowed by how many compute beside it.

``ppsim run`` on one CPU host starts ``pp x per_rank`` processes (a PP rank's FSDP/TP processes compute in lockstep),
one thread each. While more of them compute than the host has cores, each gets ``cores / computing`` of a core;
while a PP rank waits (its bubble), the others have its cores. A profile measures computations with one process per
PP rank and no more than the cores, so its costs hold when few compute at once and stretch when many do.

:func:`shared_cores_step` models this as processor sharing over the simulated timeline, by a fixed point: simulate,
give each computation the time-average of ``max(1, computing / cores)`` over its span, stretch it by that factor,
simulate again (a few rounds, each factor averaged with the previous one so the rounds settle). Collectives and
other non-computations are left as they are. No number is fitted: the cores are the host's, the timeline is the
simulator's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ppsim.ir import ActionType, Schedule
from ppsim.result import SimResult

COMPUTE = frozenset({ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B})
ROUNDS = 6


def shared_cores_step(schedule: Schedule, simulate_with: Callable[[Mapping[tuple[int, int], float]], SimResult], *,
                      per_rank: int, cores: int, extra_s: Mapping[tuple[int, int], float] | None = None,
                      rounds: int = ROUNDS) -> tuple[SimResult, dict[tuple[int, int], float]]:
    """The step of ``schedule`` when its ranks' ``per_rank`` processes each share ``cores`` cores, and the seconds
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
    for _ in range(rounds):
        seen = _factors(schedule, result, per_rank=per_rank, cores=cores)
        factor = {key: (factor[key] + seen[key]) / 2 for key in base}
        extra = dict(base_extra)
        for key, seconds in base.items():
            extra[key] = extra.get(key, 0.0) + seconds * (factor[key] - 1.0)
        result = simulate_with(extra)
    return result, extra


def _computations(schedule: Schedule) -> list[tuple[int, int]]:
    return [(r, p) for r, row in enumerate(schedule.actions) for p, a in enumerate(row) if a.type in COMPUTE]


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
