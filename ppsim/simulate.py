"""Discrete-event replay of a schedule.

Model: each rank runs its actions in order on one compute lane. An action starts when its rank is free and every
input it needs (rules from :mod:`ppsim.deps`) has arrived; an input from another rank arrives ``comm`` after its
producer ends (``CostModel.comm_delay``), one from the same rank at once. Sends and receives never block compute.
An overlapped pair waits for both halves' inputs, takes the pair's duration, and both halves end together.

Engine: in-order list scheduling. ``start = max(rank free, inputs arrived)`` and ``end = start + duration`` define
every time uniquely (ranks compete for nothing but their own lane), so any visiting order that respects the
dependencies yields the same floats: the result is deterministic by construction and no ties need breaking.
The schedule is compiled once into flat arrays (per action: its duration and the one action on another rank it
waits for, in the common case), then a tight loop advances a rank until it blocks, parks it on the action it waits
for and wakes it when that action's rank has passed it. Ranks that can never advance end the run with
:class:`~ppsim.errors.DeadlockError`. See docs/simulator.md.
"""

from __future__ import annotations

import gc
from array import array
from bisect import bisect_right
from itertools import chain
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from ppsim import deps
from ppsim.costs import CostModel, parse_costs
from ppsim.errors import DeadlockError, ScheduleFormatError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.result import RankStats, SimResult, Trace, safe_ratio

if TYPE_CHECKING:
    import numpy as np

_SINGLE_KINDS = (ActionType.F, ActionType.B, ActionType.I, ActionType.W)
_PAIR = 4
_OTHER = 5  # SEND/RECV/UNSHARD/...: no compute, no inputs, zero time
_CODE_BY_ID = {
    id(t): _SINGLE_KINDS.index(t) if t in _SINGLE_KINDS else (_PAIR if t is ActionType.OVERLAP_F_B else _OTHER)
    for t in ActionType
}
_TYPE_IDS: Any = sorted(_CODE_BY_ID)  # numpy arrays on first use (numpy is imported lazily)
_TYPE_CODES: Any = [_CODE_BY_ID[i] for i in _TYPE_IDS]
_COUNT_STEP = (1, -1, 0, -1)  # held activations: F adds one, B or W releases one, I releases none
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
    gc.disable()  # the run creates no reference cycles; collections would only rescan large lists
    try:
        prog = _Program(schedule, costs)
        end = _run(prog)
        return _finish(prog, end, memory_cap_bytes)
    finally:
        if was_enabled:
            gc.enable()


class _Program:
    """The schedule compiled to flat arrays.

    Actions are numbered rank by rank; computations (single F/B/I/W; a pair gives two) are numbered in action
    order. Without pairs the two numberings coincide and the computation arrays are the action arrays.
    """

    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        import numpy as np

        global _TYPE_IDS, _TYPE_CODES
        if isinstance(_TYPE_IDS, list):
            _TYPE_IDS, _TYPE_CODES = np.array(_TYPE_IDS, dtype=np.int64), np.array(_TYPE_CODES, dtype=np.int8)
        self.schedule = schedule
        self.costs = costs
        rows = schedule.actions
        num_ranks = len(rows)
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=num_ranks)
        offsets = np.zeros(num_ranks + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = int(offsets[-1])
        self.n = n
        self.offsets = offsets
        flat = chain.from_iterable
        stage = np.fromiter(map(_get_stage, flat(rows)), dtype=np.int64, count=n)
        type_ids = np.fromiter(map(id, map(_get_type, flat(rows))), dtype=np.int64, count=n)
        code = _TYPE_CODES[np.searchsorted(_TYPE_IDS, type_ids)]
        del type_ids
        mb: np.ndarray | None = None
        if n == 0 or int(code.max()) < _PAIR:
            try:
                mb = np.fromiter(map(_get_mb, flat(rows)), dtype=np.int64, count=n)
            except TypeError:  # a computation without a microbatch: reported below
                mb = None
        self.pair_idx = np.zeros(0, dtype=np.int64)  # actions that are overlapped pairs
        self.pair_first = np.zeros(0, dtype=np.int64)  # their forward halves' computation index
        self.pair_shares = np.zeros(0, dtype=np.float64)
        if mb is not None:
            self.simple = True
            c_owner, c_stage, c_code, c_mb = np.arange(n, dtype=np.int64), stage, code, mb
        else:
            self.simple = False
            c_owner, c_stage, c_code, c_mb = self._computations(stage, code)
        self.c_owner, self.c_stage, self.c_code, self.c_mb = c_owner, c_stage, c_code, c_mb
        num_comps = len(c_owner)
        num_stages = schedule.num_stages
        if num_comps and (int(c_stage.min()) < 0 or int(c_stage.max()) >= num_stages or int(c_mb.min()) < 0):
            bad = np.flatnonzero((c_stage < 0) | (c_stage >= num_stages) | (c_mb < 0))[0]
            a = int(c_owner[bad])
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {self.action_at(a)} needs a stage in "
                f"0..{num_stages - 1} and a microbatch >= 0; fix the action"
            )
        num_mb = int(c_mb.max()) + 1 if num_comps else 1
        self.num_mb = num_mb
        lo_of_action = np.repeat(offsets[:-1], lengths)  # first action index of each action's rank
        c_lo = lo_of_action if self.simple else lo_of_action[c_owner]

        # dependency rules compiled from ppsim.deps; stage S stands for "no input"
        req_stage, req_phase, prov_phase, num_phases = _rule_tables(schedule)
        self.num_phases = num_phases
        provider = np.full((num_stages + 1) * num_mb * num_phases, num_comps, dtype=np.int64)  # num_comps: missing
        provider[num_stages * num_mb * num_phases :] = -1
        kbase = c_stage * num_mb
        kbase += c_mb
        kbase *= num_phases
        comp_index = np.arange(num_comps, dtype=np.int64)
        provided = []
        for phases in prov_phase:
            ph = phases[c_code]
            sel = comp_index if int(ph.min(initial=0)) >= 0 else np.flatnonzero(ph >= 0)
            keys = kbase[sel] + ph[sel]
            provider[keys] = sel
            provided.append((sel, keys))
        del kbase
        for sel, keys in provided:
            lost = provider[keys] != sel
            if lost.any():
                k = int(np.flatnonzero(lost)[0])
                self._raise_duplicate(int(sel[k]), int(keys[k]))
        del provided
        self.provider = provider

        # inputs per computation -> the action each one waits for (same-rank inputs produced earlier are free)
        cell = c_stage * 4
        cell += c_code
        owner_ext = np.append(c_owner, n)  # missing input -> action n, which never ends
        lo_ext = np.append(lo_of_action, -1)
        positions = _chain_positions(schedule)
        uniform_comm = costs.p2p_alpha is None
        boundary = np.array([costs.boundary_delay(schedule, s) for s in range(num_stages)] or [0.0])
        dep = np.full(n, -1, dtype=np.int64)
        dep_delay = np.zeros(n, dtype=np.float64)
        multi: dict[int, list[tuple[int, float]]] = {}
        empty = np.zeros(0, dtype=np.int64)
        self.group_a, self.group_b = empty, empty
        self.group_delay_a, self.group_delay_b = np.zeros(0), np.zeros(0)
        xfer_parts = []
        waits = []
        mb_part = c_mb * num_phases
        for k in range(len(req_stage)):
            # provider key of the input: (stage * M + mb) * P + phase = table[cell] + mb * P
            keys = (req_stage[k] * (num_mb * num_phases) + req_phase[k])[cell]
            keys += mb_part
            prod = provider[keys]
            del keys
            po = prod if self.simple else np.where(prod >= 0, owner_ext[prod], -1)
            wait = (po >= 0) & ((po < c_lo) | (po >= c_owner))
            w = np.flatnonzero(wait)
            del wait
            pw = po[w]
            cross = lo_ext[pw] != c_lo[w]
            cross &= pw < n
            cw = w[cross]
            ps = req_stage[k][cell[cw]]
            if uniform_comm:
                delay = np.where(cross, costs.comm, 0.0)
                upstream = ps
            else:
                cs = c_stage[cw]
                upstream = np.where(positions[ps] < positions[cs], ps, cs)
                delay = np.zeros(len(w), dtype=np.float64)
                delay[cross] = boundary[upstream]
            x_delay = np.broadcast_to(np.float64(costs.comm), (len(cw),)) if uniform_comm else delay[cross]
            xfer_parts.append((prod[cw].astype(np.int32), cw.astype(np.int32), x_delay, upstream.astype(np.int32)))
            waits.append((w if self.simple else c_owner[w], pw, delay))
            del w, pw, cross
        # per action: one input to wait for (dep >= 0), two (dep = -3 - j: group j), or more (dep = -2: multi)
        if self.simple and len(waits) <= 2:
            # each action has one computation, so only the two input slots can collide: scatter, then group
            # the (rare) collisions
            for slot, (wa, pw, delay) in enumerate(waits):
                if slot:
                    taken = np.flatnonzero(dep[wa] != -1)
                    if len(taken):
                        both = wa[taken]
                        self.group_a, self.group_delay_a = dep[both], dep_delay[both]
                        self.group_b, self.group_delay_b = pw[taken], delay[taken]
                        keep = np.ones(len(wa), dtype=bool)
                        keep[taken] = False
                        wa, pw, delay = wa[keep], pw[keep], delay[keep]
                        dep[both] = -3 - np.arange(len(both), dtype=np.int64)
                dep[wa] = pw
                dep_delay[wa] = delay
        elif waits:
            wa, pw, delay = (np.concatenate(col) for col in zip(*waits)) if len(waits) > 1 else waits[0]
            order = np.argsort(wa, kind="stable")
            wa, pw, delay = wa[order], pw[order], delay[order]
            first = np.ones(len(wa), dtype=bool)
            first[1:] = wa[1:] != wa[:-1]
            starts = np.flatnonzero(first)
            sizes = np.diff(np.append(starts, len(wa)))
            one = starts[sizes == 1]
            dep[wa[one]] = pw[one]
            dep_delay[wa[one]] = delay[one]
            two = starts[sizes == 2]
            self.group_a, self.group_b = pw[two], pw[two + 1]
            self.group_delay_a, self.group_delay_b = delay[two], delay[two + 1]
            dep[wa[two]] = -3 - np.arange(len(two), dtype=np.int64)
            for j in starts[sizes > 2].tolist():
                k = j
                while k < len(wa) and wa[k] == wa[j]:
                    multi.setdefault(int(wa[j]), []).append((int(pw[k]), float(delay[k])))
                    k += 1
        for a in multi:
            dep[a] = -2
        self.dep, self.dep_delay, self.multi = dep, dep_delay, multi
        self.xfer_parts = tuple(xfer_parts)
        self.stage_out_bytes = np.full(num_stages + 1, np.nan)
        if costs.output_bytes is not None:
            for st in range(num_stages):
                self.stage_out_bytes[st] = costs.output_bytes[costs.position(schedule, st)]

        # durations: one cost table per (kind, stage); pairs through the cost model's pair rule
        op = np.zeros((6, max(num_stages, 1)), dtype=np.float64)
        for k, kind in enumerate(_SINGLE_KINDS):
            op[k, :num_stages] = [costs.op_cost(schedule, s, kind) for s in range(num_stages)]
        stage_or_0 = np.where(code < _PAIR, stage, 0) if not self.simple else stage
        duration = op[code, stage_or_0] if costs.num_positions is not None else op[:, 0][code]
        if len(self.pair_idx):
            # the cost model's pair rule, evaluated once per distinct (forward stage, backward stage, kind)
            f_stage, b_stage, b_code = c_stage[self.pair_first], c_stage[self.pair_first + 1], c_code[self.pair_first + 1]
            combo = (f_stage * max(num_stages, 1) + b_stage) * 4 + b_code
            uniq, inverse = np.unique(combo, return_inverse=True)
            split = np.array(
                [
                    costs.pair_split(schedule, int(u) // 4 // max(num_stages, 1), int(u) // 4 % max(num_stages, 1),
                                     _SINGLE_KINDS[int(u) % 4])
                    for u in uniq
                ],
                dtype=np.float64,
            ).reshape(-1, 2)
            duration[self.pair_idx] = split[inverse, 0]
            self.pair_shares = split[inverse, 1]
        self.duration = duration

        # memory: changes when a computation ends; a pair holds its forward half's activation before its
        # backward half releases one, so its high point is "held before + the positive part"
        count_step = np.array(_COUNT_STEP, dtype=np.int8)[c_code]
        self.act_delta, self.act_plus = self._per_action(count_step)
        self.byte_delta: np.ndarray | None = None
        self.byte_plus: np.ndarray | None = None
        if costs.has_memory:
            table = np.zeros((4, max(num_stages, 1)), dtype=np.int64)
            for s in range(num_stages):
                held, freed_by_i = costs.activation_of(schedule, s)
                table[:, s] = (held, -held, -freed_by_i, -(held - freed_by_i))
            self.byte_delta, self.byte_plus = self._per_action(table[c_code, c_stage])

    def _computations(self, stage: np.ndarray, code: np.ndarray) -> tuple[np.ndarray, ...]:
        """Computation arrays for orders with pairs (or non-compute actions): singles plus both halves of pairs."""
        import numpy as np

        rows = self.schedule.actions
        flat = chain.from_iterable
        mb_f = np.array(list(map(_get_mb, flat(rows))), dtype=np.float64)  # None -> NaN
        single = np.flatnonzero(code < _PAIR)
        self.pair_idx = np.flatnonzero(code == _PAIR)
        pairs: Any = ()
        if len(self.pair_idx):
            pairs = itemgetter(*self.pair_idx.tolist())(list(flat(rows)))
            pairs = pairs if len(self.pair_idx) > 1 else (pairs,)
        halves = list(flat(map(attrgetter("sub_actions"), pairs)))
        h_stage = np.fromiter(map(_get_stage, halves), dtype=np.int64, count=len(halves))
        h_ids = np.fromiter(map(id, map(_get_type, halves)), dtype=np.int64, count=len(halves))
        h_code = _TYPE_CODES[np.searchsorted(_TYPE_IDS, h_ids)]
        h_mb = np.array(list(map(_get_mb, halves)), dtype=np.float64)
        owner = np.concatenate((single, np.repeat(self.pair_idx, 2)))
        order = np.argsort(owner, kind="stable")
        c_owner = owner[order]
        c_stage = np.concatenate((stage[single], h_stage))[order]
        c_code = np.concatenate((code[single], h_code))[order]
        c_mbf = np.concatenate((mb_f[single], h_mb))[order]
        self.pair_first = np.searchsorted(c_owner, self.pair_idx)
        if np.isnan(c_mbf).any():
            a = int(c_owner[np.flatnonzero(np.isnan(c_mbf))[0]])
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {self.action_at(a)} has no microbatch; "
                "write computations as [stage][type][microbatch], e.g. 2F0"
            )
        return c_owner, c_stage, c_code, c_mbf.astype(np.int64)

    def _per_action(self, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Net change and positive part per action of a per-computation step."""
        import numpy as np

        if self.simple:
            return step, np.maximum(step, 0)
        delta = np.bincount(self.c_owner, weights=step, minlength=self.n).astype(np.int64)
        plus = np.bincount(self.c_owner, weights=np.maximum(step, 0), minlength=self.n).astype(np.int64)
        return delta, plus

    # -- names for messages -------------------------------------------------------------------------------------

    def rank_of(self, a: int) -> int:
        return bisect_right(self.offsets.tolist(), a) - 1

    def position_of(self, a: int) -> int:
        return a - int(self.offsets[self.rank_of(a)])

    def action_at(self, a: int) -> Action:
        return self.schedule.actions[self.rank_of(a)][self.position_of(a)]

    def comp_str(self, c: int) -> str:
        return f"{int(self.c_stage[c])}{_SINGLE_KINDS[int(self.c_code[c])].value}{int(self.c_mb[c])}"

    def producer_of(self, key: deps.Key) -> int:
        """Computation index providing ``key``; -1 when none does."""
        s, mb, phase = key
        if not (0 <= s < self.schedule.num_stages and 0 <= mb < self.num_mb):
            return -1
        c = int(self.provider[(s * self.num_mb + mb) * self.num_phases + phase])
        return c if c < len(self.c_owner) else -1

    def _raise_duplicate(self, comp: int, key: int) -> None:
        phase = key % self.num_phases
        rest = key // self.num_phases
        what = deps.describe((rest // self.num_mb, rest % self.num_mb, phase))
        a = int(self.c_owner[comp])
        raise ScheduleFormatError(
            f"rank {self.rank_of(a)} position {self.position_of(a)}: {self.action_at(a)} computes {what} a second "
            "time; each (stage, microbatch) needs exactly one F and one B (or one I and one W)"
        )


def _rule_tables(schedule: Schedule) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], int]:
    """From :mod:`ppsim.deps`: per input slot, tables over ``stage * 4 + kind`` of the required stage (S for no
    input) and phase, and per provided slot a table over kind of the provided phase (-1 for none)."""
    import numpy as np

    num_stages = schedule.num_stages
    reqs: list[list[tuple[int, int]]] = []
    for s in range(num_stages):
        for kind in _SINGLE_KINDS:
            probe = Action(s, kind, 1)
            got = deps.requires(schedule, probe)
            assert all(k[1] == 1 for k in got), "the simulator assumes inputs of the same microbatch"
            reqs.append([(k[0], k[2]) for k in got])
    provs: list[list[int]] = []
    for kind in _SINGLE_KINDS:
        made = deps.provides(Action(0, kind, 1))
        assert all(k[0] == 0 and k[1] == 1 for k in made), "the simulator assumes a computation provides its own keys"
        provs.append([k[2] for k in made])
    width = max((len(r) for r in reqs), default=0)
    req_stage = [np.full(max(len(reqs), 1), num_stages, dtype=np.int64) for _ in range(width)]
    req_phase = [np.zeros(max(len(reqs), 1), dtype=np.int64) for _ in range(width)]
    for i, r in enumerate(reqs):
        for j, (st, ph) in enumerate(r):
            req_stage[j][i] = st
            req_phase[j][i] = ph
    prov_phase = [np.full(6, -1, dtype=np.int64) for _ in range(max(len(p) for p in provs))]
    for k, phases in enumerate(provs):
        for j, ph in enumerate(phases):
            prov_phase[j][k] = ph
    num_phases = 1 + max([ph for p in provs for ph in p] + [ph for r in reqs for _, ph in r])
    return req_stage, req_phase, prov_phase, num_phases


def _chain_positions(schedule: Schedule) -> np.ndarray:
    import numpy as np

    pos = np.zeros(max(schedule.num_stages, 1) + 1, dtype=np.int64)
    for chain_ in schedule.pipelines:
        for i, s in enumerate(chain_):
            pos[s] = i
    return pos


def _run(prog: _Program) -> np.ndarray:
    """The event loop: the end time of every action (raises DeadlockError when ranks are stuck)."""
    import numpy as np

    n = prog.n
    dep = array("q", prog.dep.tobytes())
    delay = array("d", prog.dep_delay.tobytes())
    dur = array("d", prog.duration.tobytes())
    multi = prog.multi
    ga = array("q", prog.group_a.tobytes())
    gb = array("q", prog.group_b.tobytes())
    gda = array("d", prog.group_delay_a.tobytes())
    gdb = array("d", prog.group_delay_b.tobytes())
    offsets = prog.offsets.tolist()
    num_ranks = len(offsets) - 1
    rank_of = array("q", np.repeat(np.arange(num_ranks, dtype=np.int64), np.diff(prog.offsets)).tobytes())
    end = array("d", [-1.0]) * (n + 1)  # -1: not yet; slot n stands for an input no rank computes
    ptr = offsets[:-1]
    stops = offsets[1:]
    clock = [0.0] * num_ranks
    parked: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]  # per rank: (its action, waiting rank)
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
            elif d < -2:
                # two inputs (an overlapped pair); raising t before a later input blocks is harmless: both
                # are lower bounds of this action's start
                j = -3 - d
                d = ga[j]
                e = end[d]
                if e < 0.0:
                    break
                e += gda[j]
                if e > t:
                    t = e
                d = gb[j]
                e = end[d]
                if e < 0.0:
                    break
                e += gdb[j]
                if e > t:
                    t = e
            elif d == -2:
                blocked = False
                for d, dl in multi[i]:
                    e = end[d]
                    if e < 0.0:
                        blocked = True
                        break
                    e += dl
                    if e > t:
                        t = e
                if blocked:
                    break
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
    return np.frombuffer(end, dtype=np.float64, count=n).copy()


def _raise_deadlock(prog: _Program, end: Any, stuck: list[int], ptr: list[int]) -> None:
    schedule = prog.schedule
    blocked: dict[int, tuple[str, str]] = {}
    parts = []
    for r in stuck:
        a = ptr[r]
        head = prog.action_at(a)
        waits_for = ""
        for comp in head.computations:
            for key in deps.requires(schedule, comp):
                c = prog.producer_of(key)
                if c < 0:
                    waits_for = f"{deps.describe(key)} (no rank computes it)"
                    break
                owner = int(prog.c_owner[c])
                p_rank = prog.rank_of(owner)
                if end[owner] < 0.0 and not (p_rank == r and owner < a):
                    where = "later on the same rank" if p_rank == r else f"on rank {p_rank}"
                    waits_for = f"{prog.comp_str(c)} ({where})"
                    break
            if waits_for:
                break
        blocked[r] = (str(head), waits_for)
        parts.append(f"rank {r} at position {a - prog.offsets[r]} ({head}) waits for {waits_for}")
    raise DeadlockError(
        f"schedule {schedule.name} deadlocks under in-order execution: "
        + "; ".join(parts)
        + "; reorder so that every input is produced earlier (check with `ppsim validate`)",
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
    nonempty = offsets[:-1][offsets[:-1] < offsets[1:]]

    # start = max(rank free, inputs arrived): the loop's float operations, vectorised
    start = np.zeros(n, dtype=np.float64)
    if n > 1:
        start[1:] = end[:-1]
    start[nonempty] = 0.0
    end_ext = np.append(end, 0.0)  # index n: no input (times are >= 0, so it never wins the max)
    dep = prog.dep
    arrival = end_ext[np.where(dep >= 0, dep, n)]
    arrival += prog.dep_delay
    np.maximum(start, arrival, out=start)
    del arrival
    grouped = np.flatnonzero(dep < -2)
    if len(grouped):
        j = -3 - dep[grouped]
        arrive_a = end[prog.group_a[j]] + prog.group_delay_a[j]
        arrive_b = end[prog.group_b[j]] + prog.group_delay_b[j]
        start[grouped] = np.maximum(start[grouped], np.maximum(arrive_a, arrive_b))
    for a, inputs in prog.multi.items():
        t = float(start[a])  # the rank's free time: a many-input action got no arrival above
        for pd, dl in inputs:
            t = max(t, float(end[pd]) + dl)
        start[a] = t

    # half intervals: a pair's forward half is drawn first, in its cost share
    c_owner = prog.c_owner
    if prog.simple:
        half_start, half_end = start, end
    else:
        half_start = start[c_owner]
        half_end = end[c_owner].copy()
        if len(prog.pair_idx):
            first = prog.pair_first
            mid = start[prog.pair_idx] + duration[prog.pair_idx] * prog.pair_shares
            half_end[first] = mid
            half_start[first + 1] = mid

    makespan = float(end.max()) if n else 0.0
    busy = np.zeros(num_ranks, dtype=np.float64)
    if n:
        ranks_nonempty = np.flatnonzero(offsets[:-1] < offsets[1:])
        busy[ranks_nonempty] = np.add.reduceat(duration, nonempty)
    peak_act = _peaks(prog.act_delta, prog.act_plus, offsets)
    peak_mem = None
    if prog.byte_delta is not None and prog.byte_plus is not None:
        peak_mem = _peaks(prog.byte_delta, prog.byte_plus, offsets)
    static = [sum(costs.static_bytes_of(schedule, s) for s in schedule.stages_of(r)) for r in range(num_ranks)]
    stats = []
    for r in range(num_ranks):
        peak_bytes = None if peak_mem is None else static[r] + peak_mem[r]
        b = float(busy[r])
        idle = makespan - b
        stats.append(
            RankStats(
                rank=r,
                busy=b,
                idle=idle,
                bubble_ratio=idle / makespan if makespan > 0 else 0.0,
                peak_activations=peak_act[r],
                peak_memory_bytes=peak_bytes,
                over_memory_cap=memory_cap_bytes is not None
                and peak_bytes is not None
                and peak_bytes > memory_cap_bytes,
            )
        )
    total_busy = float(busy.sum())
    bubble = 1.0 - total_busy / (num_ranks * makespan) if makespan > 0 and num_ranks else 0.0
    trace = Trace(
        offsets=offsets,
        start=start,
        end=end,
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
        xfer_parts=prog.xfer_parts,
        stage_out_bytes=prog.stage_out_bytes,
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
