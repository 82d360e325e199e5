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

Two more things the host's cores carry, both from per-core CPU accounting of pp 2 x dp_shard 2 runs on 2 cores
(docs/memory.md, "Step time"):

- **FSDP's collectives are CPU work.** On gloo a reduce-scatter or all-gather copies and sums on the calling
  process's core (``REDUCE_GRAD`` used 10-15 ms of CPU per stage, about the profile's measured collective), so an
  exposed collective (``UNSHARD``, ``REDUCE_GRAD``) shares the cores like a computation: it counts among the
  processes working and is stretched by the same factor. Not so one whose group crosses nodes (``on_link``): its
  time is the link's, a process waiting on a socket holds no core, and its price was measured across the link with
  the same processes on the host; it is neither stretched nor counted.
- **Time-sharing is slower than the fair share.** While more processes work than cores, each computation used
  1.3-1.6x its profiled CPU time (with or without FSDP), not 1x: context switches, caches refilled, both cores
  saturated. ``scale`` (the profile's ``runtime.shared_scale``, measured by calibration's FSDP probe,
  :func:`ppsim.calibrate.measure.runtime_model.fit_shared_scale`) multiplies the share over those stretches:
  the factor is ``computing / cores x scale`` where ``computing > cores``, else 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ppsim.ir import ActionType, Schedule
from ppsim.result import SimResult

COMPUTE = frozenset({ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B})
COLLECTIVES = frozenset({ActionType.UNSHARD, ActionType.REDUCE_GRAD})
"""FSDP's exposed collectives (:func:`ppsim.step.fsdp.lower`): CPU work on a host whose cores are shared (gloo)."""
CPU_WORK = COMPUTE | COLLECTIVES
ROUNDS = 6


@dataclass(frozen=True)
class NodeLinks:
    """Where each PP rank's processes sit (per PP rank, ``(node, processes)`` pairs) and the NICs a node has. The
    collectives of different PP ranks that cross nodes at the same time share those NICs: each is priced alone (its
    own processes on a node already counted), and stretched while others use its nodes' NICs beside it
    (:func:`_link_factors`)."""

    flows: tuple[tuple[tuple[int, int], ...], ...]
    nics: int


def shared_cores_step(schedule: Schedule, simulate_with: Callable[[Mapping[tuple[int, int], float]], SimResult], *,
                      per_rank: int, cores: int, extra_s: Mapping[tuple[int, int], float] | None = None,
                      scale: float = 1.0, rounds: int = ROUNDS, on_link: frozenset[tuple[int, int]] = frozenset(),
                      links: NodeLinks | None = None) -> tuple[SimResult, dict[tuple[int, int], float]]:
    """The step of ``schedule`` when its ranks' ``per_rank`` processes share ``cores`` cores (pinned by copy of the
    pipeline where ``ppsim run`` pins them, :func:`core_plan`; ``cores`` 0: the cores not shared), and the seconds
    added per (rank, position) (``extra_s`` plus each computation's stretch). ``simulate_with(extra)`` simulates the
    schedule with ``extra`` seconds added at (rank, position). ``scale``: the time-sharing slowdown beyond the fair
    share (module docstring), applied while more processes work than cores. ``on_link``: the collectives (by
    (rank, position)) whose group crosses nodes, waiting on the link rather than working on a core; with ``links``,
    those of different PP ranks running at once share their nodes' NICs."""
    base_extra = dict(extra_s or {})
    result = simulate_with(base_extra)
    share_cores = cores > 0 and schedule.num_ranks * per_rank > cores
    link_keys = sorted(on_link) if links is not None and contended(links) else []
    if not share_cores and not link_keys:
        return result, base_extra
    # a computation's own cost (its extra is a gather inside a first forward: waited for, not worked); a
    # collective's cost is all extra (the action itself takes no time in the simulator)
    base = {key: result.ends[key[0]][key[1]] - result.starts[key[0]][key[1]]
            - (base_extra.get(key, 0.0) if schedule.actions[key[0]][key[1]].type in COMPUTE else 0.0)
            for key in _computations(schedule, on_link)} if share_cores else {}
    base.update({key: base_extra.get(key, 0.0) for key in link_keys})
    factor = dict.fromkeys(base, 1.0)
    extra = base_extra
    copies, copy_cores = sharing(per_rank, cores, schedule.num_ranks) if share_cores else (1, 1)
    for step in range(rounds):
        seen = _factors(schedule, result, per_rank=copies, cores=copy_cores, scale=scale, on_link=on_link) \
            if share_cores else {}
        if link_keys:
            assert links is not None
            seen.update(_link_factors(result, link_keys, links))
        factor = {key: (factor[key] + seen[key]) / 2 if step else seen[key] for key in base}
        extra = dict(base_extra)
        for key, seconds in base.items():
            extra[key] = extra.get(key, 0.0) + seconds * (factor[key] - 1.0)
        result = simulate_with(extra)
    return result, extra


def contended(links: NodeLinks) -> bool:
    """Whether any node carries more PP ranks' processes than its NICs (else no collective waits for another's)."""
    load: dict[int, int] = {}
    for flows in links.flows:
        for node, n in flows:
            load[node] = load.get(node, 0) + n
    return any(n > links.nics for n in load.values())


def _link_factors(result: SimResult, keys: Sequence[tuple[int, int]], links: NodeLinks
                  ) -> dict[tuple[int, int], float]:
    """Per cross-node collective (``keys``, by (PP rank, position)), the time-average over its span of how much the
    busiest of its nodes' NICs is oversubscribed beyond what it alone puts on them: ``max(1, load / max(own,
    nics))``, ``load`` the processes of every PP rank in such a collective at that moment on the node."""
    spans = {key: (result.starts[key[0]][key[1]], result.ends[key[0]][key[1]]) for key in keys}
    out: dict[tuple[int, int], float] = {}
    for key, (start, end) in spans.items():
        if end <= start:
            out[key] = 1.0
            continue
        cuts = sorted({start, end, *(t for a, b in spans.values() for t in (a, b) if start < t < end)})
        weighted = 0.0
        for a, b in zip(cuts, cuts[1:]):
            ranks = {k[0] for k, (s0, e0) in spans.items() if s0 < b and e0 > a and e0 > s0}
            worst = 1.0
            for node, own in links.flows[key[0]]:
                load = sum(n for r in ranks for m, n in links.flows[r] if m == node)
                worst = max(worst, load / max(own, links.nics))
            weighted += (b - a) * worst
        out[key] = weighted / (end - start)
    return out


def _computations(schedule: Schedule, on_link: frozenset[tuple[int, int]] = frozenset()) -> list[tuple[int, int]]:
    """The actions that work on a core: computations and FSDP's exposed collectives, but those on the link."""
    return [(r, p) for r, row in enumerate(schedule.actions) for p, a in enumerate(row)
            if a.type in CPU_WORK and (r, p) not in on_link]


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


def _factors(schedule: Schedule, result: SimResult, *, per_rank: int, cores: int,
             scale: float = 1.0, on_link: frozenset[tuple[int, int]] = frozenset()) -> dict[tuple[int, int], float]:
    """Per computation, the time-average over its span of ``computing processes / cores x scale`` where they
    outnumber the cores, else 1."""
    spans = {key: (result.starts[key[0]][key[1]], result.ends[key[0]][key[1]])
             for key in _computations(schedule, on_link)}
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
        weighted = sum((min(b, end) - max(a, start)) * (n / cores * scale if n > cores else 1.0)
                       for a, b, n in pieces if b > start and a < end)
        out[key] = weighted / (end - start)
    return out
