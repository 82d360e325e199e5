"""Discrete-event replay of a schedule.

Model: each rank runs its actions in order on one compute lane. An action starts when the rank is free and every
input it needs (rules from :mod:`ppsim.deps`) has arrived; an input from another rank arrives ``comm`` after its
producer ends (``costs.comm_delay``), one from the same rank at once. Sends and receives never block compute. An
overlapped pair waits for both halves' inputs, takes the pair's duration, and both halves end together.

Engine: in-order list scheduling. ``start = max(rank free, inputs arrived)`` and ``end = start + duration`` define
every time uniquely (ranks compete for nothing but their own lane), so any visiting order that respects the
dependencies yields the same floats: the result is deterministic by construction, with no ties to break. The
schedule is compiled once into flat arrays (one cross-rank producer per action in the common case), then a tight
loop advances one rank until it blocks, parks it on the action it waits for and wakes it when that action's rank
has passed it. A rank that can never advance ends the run with :class:`~ppsim.errors.DeadlockError`.
"""

from __future__ import annotations

import gc
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING
from ppsim import deps
from ppsim.costs import CostModel, parse_costs
from ppsim.errors import DeadlockError, ScheduleFormatError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.result import RankStats, SimResult, Trace, safe_ratio

if TYPE_CHECKING:
    import numpy as np

_SINGLE_KINDS = (ActionType.F, ActionType.B, ActionType.I, ActionType.W)
_PAIR = 4
_OTHER = 5
_TYPES_BY_ID = sorted(ActionType, key=id)
_TYPE_IDS = [id(t) for t in _TYPES_BY_ID]
_TYPE_CODES = [
    _SINGLE_KINDS.index(t) if t in _SINGLE_KINDS else (_PAIR if t is ActionType.OVERLAP_F_B else _OTHER)
    for t in _TYPES_BY_ID
]
_get_stage = attrgetter("stage")
_get_type = attrgetter("type")
_get_mb = attrgetter("microbatch")


def simulate(
    schedule: Schedule, costs: CostModel | None = None, *, memory_cap_bytes: int | None = None
) -> SimResult:
    """Replay ``schedule`` under ``costs`` (default: ``parse_costs(None)``) and return the timed result."""
    costs = parse_costs(None) if costs is None else costs
    costs.check(schedule)
    was_enabled = gc.isenabled()
    gc.disable()  # the run allocates no cycles; collections would only rescan big lists
    try:
        return _simulate(schedule, costs, memory_cap_bytes)
    finally:
        if was_enabled:
            gc.enable()


def _simulate(schedule: Schedule, costs: CostModel, memory_cap_bytes: int | None) -> SimResult:
    prog = _Program(schedule, costs)
    end = _run(prog)
    return _finish(prog, end, memory_cap_bytes)


class _Program:
    """The schedule compiled to flat arrays."""

    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        import numpy as np

        self.schedule = schedule
        self.costs = costs
        rows = schedule.actions
        num_ranks = len(rows)
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=num_ranks)
        offsets = np.zeros(num_ranks + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = int(offsets[-1])
        self.offsets = offsets
        self.n = n
        stage = np.fromiter(map(_get_stage, chain.from_iterable(rows)), dtype=np.int64, count=n)
        type_ids = np.fromiter(map(id, map(_get_type, chain.from_iterable(rows))), dtype=np.int64, count=n)
        code = np.array(_TYPE_CODES)[np.searchsorted(np.array(_TYPE_IDS), type_ids)]
        mb_f = np.array(list(map(_get_mb, chain.from_iterable(rows))), dtype=np.float64)
        rank = np.repeat(np.arange(num_ranks, dtype=np.int64), lengths)
        self.rank = rank

        # computations: single actions, then the halves of pairs
        single = np.flatnonzero(code < _PAIR)
        pair_idx = np.flatnonzero(code == _PAIR)
        flat: list[Action] | None = None
        pair_halves: list[tuple[Action, Action]] = []
        if len(pair_idx):
            flat = list(chain.from_iterable(rows))
            pair_halves = [flat[i].sub_actions for i in pair_idx.tolist()]  # type: ignore[misc]
        half_stage = np.array([h.stage for hs in pair_halves for h in hs], dtype=np.int64)
        half_code = np.array([_SINGLE_KINDS.index(h.type) for hs in pair_halves for h in hs], dtype=np.int64)
        half_mb = np.array(
            [np.nan if h.microbatch is None else h.microbatch for hs in pair_halves for h in hs], dtype=np.float64
        )
        c_owner = np.concatenate((single, np.repeat(pair_idx, 2)))
        c_stage = np.concatenate((stage[single], half_stage))
        c_code = np.concatenate((code[single], half_code))
        c_mbf = np.concatenate((mb_f[single], half_mb))
        order = np.argsort(c_owner, kind="stable")  # computations in (action, half) order
        c_owner, c_stage, c_code, c_mbf = c_owner[order], c_stage[order], c_code[order], c_mbf[order]
        num_stages = schedule.num_stages
        bad = (c_stage < 0) | (c_stage >= num_stages) | np.isnan(c_mbf)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            a = int(c_owner[i])
            r = int(rank[a])
            raise ScheduleFormatError(
                f"rank {r} position {a - int(offsets[r])}: {schedule.actions[r][a - int(offsets[r])]} needs a stage "
                f"in 0..{num_stages - 1} and a microbatch; fix the action"
            )
        c_mb = c_mbf.astype(np.int64)
        self.c_owner, self.c_stage, self.c_code, self.c_mb = c_owner, c_stage, c_code, c_mb
        num_mb = int(c_mb.max()) + 1 if len(c_mb) else 1
        self.num_mb = num_mb

        # dependency rules, compiled from ppsim.deps per (stage, kind)
        req_stage, req_phase, prov_phase, num_phases = _rule_tables(schedule)
        self.num_phases = num_phases
        cell = c_stage * 4 + c_code
        provider = np.full(max(num_stages, 1) * num_mb * num_phases, -1, dtype=np.int64)
        base = (c_stage * num_mb + c_mb) * num_phases
        comp_index = np.arange(len(c_owner), dtype=np.int64)
        for slot in range(prov_phase.shape[1]):
            phase = prov_phase[c_code, slot]
            has = phase >= 0
            keys = base[has] + phase[has]
            provider[keys] = comp_index[has]
            dup = provider[keys] != comp_index[has]
            if dup.any():
                c = int(comp_index[has][np.flatnonzero(dup)[0]])
                raise ScheduleFormatError(
                    f"{self.comp_str(c)} (rank {self.comp_rank(c)}) computes "
                    f"{deps.describe(self._key_tuple(int(keys[np.flatnonzero(dup)[0]])))} a second time; "
                    "each (stage, microbatch) needs exactly one F and one B (or one I and one W)"
                )
        self.provider = provider

        # per computation inputs -> (consumer comp, producer comp, producer stage)
        cons_l, prod_l, pstage_l = [], [], []
        for slot in range(req_stage.shape[1]):
            rs = req_stage[cell, slot]
            has = rs >= 0
            idx = comp_index[has]
            keys = (rs[has] * num_mb + c_mb[has]) * num_phases + req_phase[cell[has], slot]
            cons_l.append(idx)
            prod_l.append(provider[keys])
            pstage_l.append(rs[has])
        cons = np.concatenate(cons_l)
        prod = np.concatenate(prod_l)
        pstage = np.concatenate(pstage_l)
        missing = prod < 0
        c_rank = rank[c_owner]
        cons_owner = c_owner[cons]
        prod_owner = np.where(missing, n, c_owner[np.where(missing, 0, prod)])
        prod_rank = np.where(missing, -1, rank[np.minimum(prod_owner, max(n - 1, 0))])
        cross = (prod_rank != c_rank[cons]) & ~missing
        # same-rank inputs produced earlier in the order are free; anything else must be waited for
        wait = cross | missing | (prod_owner >= cons_owner)

        pos = _chain_positions(schedule)
        boundary = np.array([costs.boundary_delay(schedule, s) for s in range(num_stages)] or [0.0])
        cstage = c_stage[cons]
        upstream = np.where(pos[pstage] < pos[cstage], pstage, cstage)
        delay = np.where(cross, boundary[upstream], 0.0)

        x = np.flatnonzero(cross)
        self.xfer_producer = prod[x]
        self.xfer_consumer = cons[x]
        self.xfer_delay = delay[x]
        if costs.output_bytes is not None:
            out_bytes = np.array([costs.output_bytes[costs.position(schedule, s)] for s in range(num_stages)])
            self.xfer_bytes = out_bytes[upstream[x]].astype(np.float64)
        else:
            self.xfer_bytes = np.full(len(x), np.nan)

        w = np.flatnonzero(wait)
        w_owner = cons_owner[w]
        counts = np.bincount(w_owner, minlength=n) if n else np.zeros(0, dtype=np.int64)
        dep = np.full(n, -1, dtype=np.int64)
        dep_delay = np.zeros(n, dtype=np.float64)
        one = counts[w_owner] == 1
        dep[w_owner[one]] = prod_owner[w[one]]
        dep_delay[w_owner[one]] = delay[w[one]]
        multi: dict[int, list[tuple[int, float]]] = {}
        for k in np.flatnonzero(~one).tolist():
            multi.setdefault(int(w_owner[k]), []).append((int(prod_owner[w[k]]), float(delay[w[k]])))
        for a in multi:
            dep[a] = -2
        self.dep = dep
        self.dep_delay = dep_delay
        self.multi = multi

        # durations and memory deltas
        op = np.array(
            [[costs.op_cost(schedule, s, k) for s in range(num_stages)] or [0.0] for k in _SINGLE_KINDS],
            dtype=np.float64,
        )
        duration = np.zeros(n, dtype=np.float64)
        duration[single] = op[code[single], stage[single]]
        shares: list[float] = []
        for a, (f, b) in zip(pair_idx.tolist(), pair_halves):
            d, forward_share = costs.pair_split(schedule, f.stage, b.stage, b.type)
            duration[a] = d
            shares.append(forward_share)
        self.duration = duration
        self.pair_idx = pair_idx
        self.pair_shares = np.array(shares, dtype=np.float64)

        # memory: a computation changes held activations when it ends; an overlapped pair holds its forward
        # half's activation before its backward half frees one, so its peak is "before + the positive part"
        count_step = np.array([1, -1, 0, -1], dtype=np.int64)[c_code]
        self.act_delta, self.act_plus = _per_action(c_owner, count_step, n)
        self.byte_delta: np.ndarray | None = None
        self.byte_plus: np.ndarray | None = None
        if costs.has_memory:
            held = np.array([costs.activation_of(schedule, s)[0] for s in range(num_stages)], dtype=np.int64)
            freed_i = np.array([costs.activation_of(schedule, s)[1] for s in range(num_stages)], dtype=np.int64)
            h, f = held[c_stage], freed_i[c_stage]
            byte_step = np.select([c_code == 0, c_code == 1, c_code == 2], [h, -h, -f], default=-(h - f))
            self.byte_delta, self.byte_plus = _per_action(c_owner, byte_step, n)

    # -- names for messages -------------------------------------------------------------------------------------

    def _key_tuple(self, key: int) -> deps.Key:
        phase = key % self.num_phases
        rest = key // self.num_phases
        return (rest // self.num_mb, rest % self.num_mb, phase)

    def comp_rank(self, c: int) -> int:
        return int(self.rank[int(self.c_owner[c])])

    def action_at(self, a: int) -> Action:
        r = int(self.rank[a])
        return self.schedule.actions[r][a - int(self.offsets[r])]

    def comp_str(self, c: int) -> str:
        return f"{int(self.c_stage[c])}{_SINGLE_KINDS[int(self.c_code[c])].value}{int(self.c_mb[c])}"


def _per_action(owner: np.ndarray, step: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Net change and positive part per action of a per-computation step."""
    import numpy as np

    delta = np.bincount(owner, weights=step, minlength=n).astype(np.int64)
    plus = np.bincount(owner, weights=np.maximum(step, 0), minlength=n).astype(np.int64)
    return delta, plus


def _rule_tables(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per (stage, kind): the stages/phases each computation requires and the phases it provides (from deps)."""
    import numpy as np

    num_stages = schedule.num_stages
    reqs: list[list[tuple[int, int]]] = []
    provs: list[list[int]] = []
    for s in range(num_stages):
        for kind in _SINGLE_KINDS:
            probe = Action(s, kind, 1)
            got = deps.requires(schedule, probe)
            assert all(k[1] == 1 for k in got), "deps rules are assumed to keep the microbatch"
            reqs.append([(k[0], k[2]) for k in got])
            made = deps.provides(probe)
            assert all(k[0] == s and k[1] == 1 for k in made)
            provs.append([k[2] for k in made])
    for kind in _SINGLE_KINDS:  # provides() does not depend on the stage; keep the table even with no stages
        provs.append([k[2] for k in deps.provides(Action(0, kind, 1))])
    width = max((len(r) for r in reqs), default=0) or 1
    req_stage = np.full((max(len(reqs), 1), width), -1, dtype=np.int64)
    req_phase = np.zeros((max(len(reqs), 1), width), dtype=np.int64)
    for i, r in enumerate(reqs):
        for j, (st, ph) in enumerate(r):
            req_stage[i, j] = st
            req_phase[i, j] = ph
    prov_phase = np.full((4, max(len(p) for p in provs)), -1, dtype=np.int64)
    for k in range(4):
        for j, ph in enumerate(provs[-4 + k]):
            prov_phase[k, j] = ph
    num_phases = int(max(req_phase.max(initial=0), prov_phase.max(initial=0))) + 1
    return req_stage, req_phase, prov_phase, num_phases


def _chain_positions(schedule: Schedule) -> np.ndarray:
    import numpy as np

    pos = np.zeros(max(schedule.num_stages, 1), dtype=np.int64)
    for chain_ in schedule.pipelines:
        for i, s in enumerate(chain_):
            pos[s] = i
    return pos


def _run(prog: _Program) -> np.ndarray:
    """The event loop: end time of every action (raises DeadlockError when ranks are stuck)."""
    import numpy as np

    n = prog.n
    dep = prog.dep.tolist()
    delay = prog.dep_delay.tolist()
    dur = prog.duration.tolist()
    multi = prog.multi
    rank_of = prog.rank.tolist()
    offsets = prog.offsets.tolist()
    num_ranks = len(offsets) - 1
    end = [-1.0] * (n + 1)  # slot n stands for an input no rank computes
    ptr = offsets[:-1]
    stops = offsets[1:]
    clock = [0.0] * num_ranks
    parked: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]  # per producer rank: (action, waiter)
    ready = list(range(num_ranks - 1, -1, -1))
    pop = ready.pop
    push = ready.append
    while ready:
        r = pop()
        i = ptr[r]
        stop = stops[r]
        t = clock[r]
        d = -1
        while i < stop:
            d = dep[i]
            if d >= 0:
                e = end[d]
                if e < 0.0:
                    break
                e += delay[i]
                if e > t:
                    t = e
            elif d == -2:
                blocked = -1
                u = t
                for pd, dl in multi[i]:
                    e = end[pd]
                    if e < 0.0:
                        blocked = pd
                        break
                    e += dl
                    if e > u:
                        u = e
                if blocked >= 0:
                    d = blocked
                    break
                t = u
            t += dur[i]
            end[i] = t
            i += 1
        ptr[r] = i
        clock[r] = t
        waiting = parked[r]
        if waiting:
            still = []
            for a, waiter in waiting:
                if a < i:
                    push(waiter)
                else:
                    still.append((a, waiter))
            parked[r] = still
        if i < stop and d < n:
            parked[rank_of[d]].append((d, r))
    stuck = [r for r in range(num_ranks) if ptr[r] < stops[r]]
    if stuck:
        _raise_deadlock(prog, end, stuck, ptr)
    return np.array(end[:n], dtype=np.float64)


def _raise_deadlock(prog: _Program, end: list[float], stuck: list[int], ptr: list[int]) -> None:
    schedule = prog.schedule
    blocked: dict[int, tuple[str, str]] = {}
    parts = []
    for r in stuck:
        a = ptr[r]
        head = prog.action_at(a)
        waits_for = "?"
        for comp in head.computations:
            for key in deps.requires(schedule, comp):
                s, mb, phase = key
                c = -1
                if 0 <= s < schedule.num_stages and mb < prog.num_mb:
                    c = int(prog.provider[(s * prog.num_mb + mb) * prog.num_phases + phase])
                if c < 0:
                    waits_for = f"{deps.describe(key)} (no rank computes it)"
                    break
                owner = int(prog.c_owner[c])
                if end[owner] < 0.0 and not (int(prog.rank[owner]) == r and owner < a):
                    here = "later on the same rank" if int(prog.rank[owner]) == r else f"on rank {prog.comp_rank(c)}"
                    waits_for = f"{prog.comp_str(c)} ({here})"
                    break
            if waits_for != "?":
                break
        blocked[r] = (str(head), waits_for)
        parts.append(f"rank {r} at position {a - int(prog.offsets[r])} ({head}) waits for {waits_for}")
    raise DeadlockError(
        f"schedule {schedule.name} deadlocks under in-order execution: " + "; ".join(parts)
        + "; reorder so every input is produced earlier (check with `ppsim validate`)",
        blocked,
    )


def _peaks(delta: np.ndarray, plus: np.ndarray, offsets: np.ndarray) -> list[int]:
    """Per rank: the most held at once, ``max(0, held before an action + its positive part)``."""
    import numpy as np

    held_after = np.cumsum(delta)
    high = held_after - delta + plus
    peaks = []
    for r in range(len(offsets) - 1):
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        if hi == lo:
            peaks.append(0)
            continue
        base = int(held_after[lo - 1]) if lo > 0 else 0
        peaks.append(max(0, int(high[lo:hi].max()) - base))
    return peaks


def _finish(prog: _Program, end: np.ndarray, memory_cap_bytes: int | None) -> SimResult:
    import numpy as np

    schedule, costs = prog.schedule, prog.costs
    n = prog.n
    offsets = prog.offsets
    num_ranks = len(offsets) - 1
    duration = prog.duration

    # start = max(rank free, inputs arrived): the same float operations as the loop, vectorised
    prev_end = np.zeros(n, dtype=np.float64)
    if n > 1:
        prev_end[1:] = end[:-1]
    firsts = offsets[:-1][offsets[:-1] < offsets[1:]]
    prev_end[firsts] = 0.0
    start = prev_end.copy()
    has = prog.dep >= 0
    arrival = end[prog.dep[has]] + prog.dep_delay[has]
    start[has] = np.maximum(prev_end[has], arrival)
    for a, inputs in prog.multi.items():
        t = float(prev_end[a])
        for pd, dl in inputs:
            t = max(t, float(end[pd]) + dl)
        start[a] = t

    # half intervals: a pair's forward half first, in its cost share
    c_owner = prog.c_owner
    half_start = start[c_owner].copy()
    half_end = end[c_owner].copy()
    if len(prog.pair_idx):
        first = np.flatnonzero(np.isin(c_owner, prog.pair_idx) & np.r_[True, c_owner[1:] != c_owner[:-1]])
        shares = prog.pair_shares
        owners = c_owner[first]
        mid = start[owners] + duration[owners] * shares
        half_end[first] = mid
        half_start[first + 1] = mid

    makespan = float(end.max()) if n else 0.0
    busy = np.add.reduceat(duration, offsets[:-1]) if n else np.zeros(num_ranks)
    busy = np.where(offsets[:-1] < offsets[1:], busy, 0.0) if n else busy
    peak_act = _peaks(prog.act_delta, prog.act_plus, offsets)
    peak_mem = None
    if prog.byte_delta is not None and prog.byte_plus is not None:
        peak_mem = _peaks(prog.byte_delta, prog.byte_plus, offsets)
    static = [sum(costs.static_bytes_of(schedule, s) for s in schedule.stages_of(r)) for r in range(num_ranks)]
    stats = []
    for r in range(num_ranks):
        peak = peak_act[r]
        peak_bytes = None if peak_mem is None else static[r] + peak_mem[r]
        b = float(busy[r])
        idle = makespan - b
        stats.append(
            RankStats(
                rank=r,
                busy=b,
                idle=idle,
                bubble_ratio=safe_ratio(idle, makespan) if makespan > 0 else 0.0,
                peak_activations=peak,
                peak_memory_bytes=peak_bytes,
                over_memory_cap=memory_cap_bytes is not None and peak_bytes is not None
                and peak_bytes > memory_cap_bytes,
            )
        )
    total_busy = float(busy.sum())
    bubble = 1.0 - total_busy / (num_ranks * makespan) if makespan > 0 and num_ranks else 0.0
    trace = Trace(
        offsets=offsets,
        start=start,
        end=end,
        duration=duration,
        act_delta=prog.act_delta,
        act_plus=prog.act_plus,
        byte_delta=prog.byte_delta,
        byte_plus=prog.byte_plus,
        static_bytes=tuple(static),
        comp_owner=c_owner,
        comp_stage=prog.c_stage,
        comp_type=prog.c_code,
        comp_mb=prog.c_mb,
        comp_half_start=half_start,
        comp_half_end=half_end,
        xfer_producer=prog.xfer_producer,
        xfer_consumer=prog.xfer_consumer,
        xfer_delay=prog.xfer_delay,
        xfer_bytes=prog.xfer_bytes,
    )
    return SimResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        bubble_ratio=bubble,
        throughput=safe_ratio(schedule.num_microbatches, makespan),
        per_rank=tuple(stats),
        memory_cap_bytes=memory_cap_bytes,
        trace=trace,
    )

