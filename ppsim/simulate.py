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
from functools import lru_cache
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Iterator

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
_COUNT_STEP = (1, -1, 0, -1)  # held activations: F adds one, B or W releases one, I releases none
_get_stage = attrgetter("stage")
_get_type = attrgetter("type")
_get_mb = attrgetter("microbatch")
_get_sub = attrgetter("sub_actions")


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
        self.schedule = schedule
        self.costs = costs
        self._read_actions()
        self._index_providers()
        self._durations()
        self._wire_inputs()
        self._memory()

    def _read_actions(self) -> None:
        """Stage, kind and microbatch of every action and computation, pulled out at C speed."""
        import numpy as np

        rows = self.schedule.actions
        num_ranks = len(rows)
        self.lengths = np.fromiter(map(len, rows), dtype=np.int64, count=num_ranks)
        self.offsets = np.zeros(num_ranks + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        n = self.n = int(self.offsets[-1])
        flat = chain.from_iterable
        type_ids = np.fromiter(map(id, map(_get_type, flat(rows))), dtype=np.int64, count=n)
        self.code = _codes(type_ids)
        del type_ids
        self.pair_idx = np.zeros(0, dtype=np.int64)  # actions that are overlapped pairs
        self.pair_first = np.zeros(0, dtype=np.int64)  # their forward halves' computation index
        self.pair_shares = np.zeros(0, dtype=np.float64)
        self.simple = n == 0 or int(self.code.max()) < _PAIR
        if self.simple:
            self.stage = np.fromiter(map(_get_stage, flat(rows)), dtype=np.int64, count=n)
            try:
                mb = np.fromiter(map(_get_mb, flat(rows)), dtype=np.int64, count=n)
            except TypeError:  # a computation without a microbatch: reported by _computations
                self.simple = False
        if self.simple:
            self.c_owner, self.c_stage, self.c_code, self.c_mb = np.arange(n, dtype=np.int64), self.stage, self.code, mb
        else:
            self.c_owner, self.c_stage, self.c_code, self.c_mb = self._computations()
        c_stage, c_mb = self.c_stage, self.c_mb
        num_stages = self.schedule.num_stages
        if len(c_stage) and (int(c_stage.min()) < 0 or int(c_stage.max()) >= num_stages or int(c_mb.min()) < 0):
            bad = np.flatnonzero((c_stage < 0) | (c_stage >= num_stages) | (c_mb < 0))[0]
            a = int(self.c_owner[bad])
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {self.action_at(a)} needs a stage in "
                f"0..{num_stages - 1} and a microbatch >= 0; fix the action"
            )
        self.num_mb = int(c_mb.max()) + 1 if len(c_mb) else 1

    def _index_providers(self) -> None:
        """``provider[(stage * M + mb) * P + phase]``: the computation that makes each key (deps.provides)."""
        import numpy as np

        req_stage, req_phase, prov_phase, num_phases = _rule_tables(self.schedule)
        self.req_stage, self.req_phase, self.num_phases = req_stage, req_phase, num_phases
        num_stages, num_mb, num_comps = self.schedule.num_stages, self.num_mb, len(self.c_owner)
        # num_comps marks a key nobody provides; the extra stage S (no input) maps to -1
        provider = np.full((num_stages + 1) * num_mb * num_phases, num_comps, dtype=np.int64)
        provider[num_stages * num_mb * num_phases :] = -1
        kbase = self.c_stage * num_mb
        kbase += self.c_mb
        kbase *= num_phases
        comp_index = self.c_owner if self.simple else np.arange(num_comps, dtype=np.int64)
        provided = []
        for phases in prov_phase:
            ph = phases[self.c_code]
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
        self.provider = provider

    def _wire_inputs(self) -> None:
        """Per computation input (deps.requires): the action it waits for, the delay, and the rank crossings."""
        import numpy as np

        schedule, costs, n = self.schedule, self.costs, self.n
        num_stages, num_mb, num_phases = schedule.num_stages, self.num_mb, self.num_phases
        c_owner, c_stage = self.c_owner, self.c_stage
        # first action index of each action's rank; entry n (an input nobody provides) is on no rank
        lo_ext = np.repeat(np.append(self.offsets[:-1], -1), np.append(self.lengths, 1))
        c_lo = lo_ext[:n] if self.simple else lo_ext[c_owner]
        owner_ext = None if self.simple else np.append(c_owner, n)  # nobody provides it: wait for action n
        positions = _chain_positions(schedule)
        uniform_comm = costs.p2p_alpha is None
        boundary = np.array([costs.boundary_delay(schedule, s) for s in range(num_stages)] or [0.0])
        cell = c_stage * 4
        cell += self.c_code
        mb_part = self.c_mb * num_phases
        xfer_parts = []
        waits = []
        for req_stage, req_phase in zip(self.req_stage, self.req_phase):
            # provider key of the input: (stage * M + mb) * P + phase = table[cell] + mb * P
            keys = (req_stage * (num_mb * num_phases) + req_phase)[cell]
            keys += mb_part
            prod = self.provider[keys]
            del keys
            po = prod if owner_ext is None else np.where(prod >= 0, owner_ext[prod], -1)
            # same-rank inputs produced earlier in the order are free; anything else must be waited for
            w = np.flatnonzero((po >= 0) & ((po < c_lo) | (po >= c_owner)))
            pw = po[w]
            cross = lo_ext[pw] != c_lo[w]
            cross &= pw < n
            cw = w[cross]
            ps = req_stage[cell[cw]]
            if uniform_comm:
                delay = np.where(cross, costs.comm, 0.0)
                upstream = ps
                x_delay = np.broadcast_to(np.float64(costs.comm), (len(cw),))
            else:
                cs = c_stage[cw]
                upstream = np.where(positions[ps] < positions[cs], ps, cs)
                delay = np.zeros(len(w), dtype=np.float64)
                delay[cross] = boundary[upstream]
                x_delay = delay[cross]
            xfer_parts.append((prod[cw].astype(np.int32), cw.astype(np.int32), x_delay, upstream.astype(np.int32)))
            waits.append((w if self.simple else c_owner[w], pw, delay))
        self.xfer_parts = tuple(xfer_parts)
        self.stage_out_bytes = np.full(num_stages + 1, np.nan)
        if costs.output_bytes is not None:
            for st in range(num_stages):
                self.stage_out_bytes[st] = costs.output_bytes[costs.position(schedule, st)]
        self._assign_waits(waits, lo_ext)

    def _assign_waits(self, waits: list[tuple[np.ndarray, np.ndarray, np.ndarray]], lo_ext: np.ndarray) -> None:
        """Per action: one input to wait for (``dep >= 0``), two (``dep = -3 - j``: group j), or more (``dep = -2``,
        listed in ``multi``); ``dep = -1``: nothing to wait for. ``lo_ext``: first action of each action's rank."""
        import numpy as np

        n = self.n
        dep = np.full(n, -1, dtype=np.int64)
        dep_delay = np.zeros(n, dtype=np.float64)
        multi: dict[int, list[tuple[int, float]]] = {}
        empty = np.zeros(0, dtype=np.int64)
        self.group_a, self.group_b = empty, empty
        self.group_delay_a, self.group_delay_b = np.zeros(0), np.zeros(0)
        if self.simple and len(waits) <= 2:
            # one computation per action: only the input slots can collide; scatter, then group the (rare)
            # collisions
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
            wa, pw, delay = (np.concatenate(col) for col in zip(*waits))
            order = np.argsort(wa, kind="stable")
            wa, pw, delay = wa[order], pw[order], delay[order]
            first = np.ones(len(wa), dtype=bool)
            first[1:] = wa[1:] != wa[:-1]
            starts = np.flatnonzero(first)
            sizes = np.diff(np.append(starts, len(wa)))
            one = starts[sizes == 1]
            two = starts[sizes == 2]
            if (self.duration >= 0.0).all():
                # two inputs made on one rank (an overlapped pair fed by one neighbour): there the later producer
                # ends no earlier, so when its delay is no smaller it alone decides the start
                a, b = pw[two], pw[two + 1]
                same = (lo_ext[a] == lo_ext[b]) & (a < n) & (b < n)
                b_decides = same & (a <= b) & (delay[two] <= delay[two + 1])
                a_decides = same & ~b_decides & (b <= a) & (delay[two + 1] <= delay[two])
                one = np.concatenate((one, two[b_decides] + 1, two[a_decides]))
                two = two[~(a_decides | b_decides)]
            dep[wa[one]] = pw[one]
            dep_delay[wa[one]] = delay[one]
            self.group_a, self.group_b = pw[two], pw[two + 1]
            self.group_delay_a, self.group_delay_b = delay[two], delay[two + 1]
            dep[wa[two]] = -3 - np.arange(len(two), dtype=np.int64)
            for j, size in zip(starts[sizes > 2].tolist(), sizes[sizes > 2].tolist()):
                multi[int(wa[j])] = [(int(pw[k]), float(delay[k])) for k in range(j, j + size)]
        for a in multi:
            dep[a] = -2
        self.dep, self.dep_delay, self.multi = dep, dep_delay, multi

    def _durations(self) -> None:
        """One cost per (kind, stage) from the cost model; pairs through its pair rule."""
        import numpy as np

        schedule, costs = self.schedule, self.costs
        width = max(schedule.num_stages, 1)
        op = np.zeros((6, width), dtype=np.float64)
        for k, kind in enumerate(_SINGLE_KINDS):
            op[k, : schedule.num_stages] = [costs.op_cost(schedule, s, kind) for s in range(schedule.num_stages)]
        if costs.num_positions is None:
            duration = op[:, 0][self.code]
        else:
            duration = op[self.code, self.stage]
        if len(self.pair_idx):
            # evaluated once per distinct (forward stage, backward stage, backward kind)
            f = self.pair_first
            combo = (self.c_stage[f] * width + self.c_stage[f + 1]) * 4 + self.c_code[f + 1]
            uniq, inverse = np.unique(combo, return_inverse=True)
            rule = costs.pair_split
            split = np.array(
                [rule(schedule, u // 4 // width, u // 4 % width, _SINGLE_KINDS[u % 4]) for u in uniq.tolist()],
                dtype=np.float64,
            ).reshape(-1, 2)
            duration[self.pair_idx] = split[inverse, 0]
            self.pair_shares = split[inverse, 1]
        self.duration = duration

    def _memory(self) -> None:
        """Changes of held activations (count, and bytes with a profile) when each action ends.

        An overlapped pair holds its forward half's new activation before its backward half releases one, so its
        high point is "held before + the positive part" (``*_plus``)."""
        import numpy as np

        schedule, costs = self.schedule, self.costs
        count_step = np.array(_COUNT_STEP, dtype=np.int8)[self.c_code]
        self.act_delta, self.act_plus = self._per_action(count_step)
        self.byte_delta: np.ndarray | None = None
        self.byte_plus: np.ndarray | None = None
        if costs.has_memory:
            table = np.zeros((4, max(schedule.num_stages, 1)), dtype=np.int64)
            for s in range(schedule.num_stages):
                held, freed_by_i = costs.activation_of(schedule, s)
                table[:, s] = (held, -held, -freed_by_i, -(held - freed_by_i))
            self.byte_delta, self.byte_plus = self._per_action(table[self.c_code, self.c_stage])

    def _computations(self) -> tuple[np.ndarray, ...]:
        """Computation arrays for orders with pairs (or non-compute actions): singles plus both halves of pairs.

        Computations are laid out by scatter: action ``a`` owns ``per_action[a]`` slots (1 single, 2 pair, 0 other)
        from ``c_start[a]`` on, so the halves' fields go straight to their slots without sorting."""
        import numpy as np

        code, n = self.code, self.n
        flat = list(chain.from_iterable(self.schedule.actions))
        single = np.flatnonzero(code < _PAIR)
        self.pair_idx = pair_idx = np.flatnonzero(code == _PAIR)
        halves = list(chain.from_iterable(map(_get_sub, _pick(flat, pair_idx))))
        if len(halves) != 2 * len(pair_idx):
            a = next(int(a) for a in pair_idx if len(flat[a].sub_actions) != 2)
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {flat[a]} must hold exactly two actions; "
                "write it as (sF m;sB m)OVERLAP_F_B"
            )
        per_action = (code < _PAIR).view(np.int8) + 2 * (code == _PAIR).view(np.int8)
        c_start = np.cumsum(per_action, dtype=np.int64)
        num_comps = int(c_start[-1]) if n else 0
        c_start -= per_action
        c_owner = np.repeat(np.arange(n, dtype=np.int64), per_action)
        self.pair_first = first = c_start[pair_idx]
        c_stage = np.empty(num_comps, dtype=np.int64)
        c_code = np.empty(num_comps, dtype=np.int8)
        c_mb = np.empty(num_comps, dtype=np.int64)
        at = c_start[single]
        c_code[at] = code[single]
        singles = list(_pick(flat, single))
        self.stage = np.zeros(n, dtype=np.int64)  # per action: the stage of a single computation, else 0
        self.stage[single] = np.fromiter(map(_get_stage, singles), dtype=np.int64, count=len(singles))
        c_stage[at] = self.stage[single]
        c_mb[at] = self._microbatches(singles, single)
        h_stage = np.fromiter(map(_get_stage, halves), dtype=np.int64, count=len(halves))
        h_code = _codes(np.fromiter(map(id, map(_get_type, halves)), dtype=np.int64, count=len(halves)))
        h_mb = self._microbatches(halves, np.repeat(pair_idx, 2))
        for half in (0, 1):
            c_stage[first + half] = h_stage[half::2]
            c_code[first + half] = h_code[half::2]
            c_mb[first + half] = h_mb[half::2]
        return c_owner, c_stage, c_code, c_mb

    def _microbatches(self, comps: list[Action], owners: np.ndarray) -> np.ndarray:
        """Microbatch of each computation; a computation without one (owned by action ``owners[k]``) is an error."""
        import numpy as np

        try:
            return np.fromiter(map(_get_mb, comps), dtype=np.int64, count=len(comps))
        except TypeError:
            a = int(owners[next(k for k, c in enumerate(comps) if c.microbatch is None)])
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {self.action_at(a)} has no microbatch; "
                "write computations as [stage][type][microbatch], e.g. 2F0"
            ) from None

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


@lru_cache(maxsize=1)
def _type_tables() -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``id()`` of every ActionType and the matching kind codes (numpy is imported on first use)."""
    import numpy as np

    ids = sorted(_CODE_BY_ID)
    return np.array(ids, dtype=np.int64), np.array([_CODE_BY_ID[i] for i in ids], dtype=np.int8)


def _codes(type_ids: np.ndarray) -> np.ndarray:
    """Kind codes from the ``id()`` of action types (identity is what C-level ``map`` can read fast)."""
    import numpy as np

    ids, codes = _type_tables()
    return codes[np.searchsorted(ids, type_ids)]


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


def _pick(items: list[Any], idx: np.ndarray) -> Iterator[Any]:
    """``items[i] for i in idx`` at C speed."""
    return map(items.__getitem__, idx.tolist())


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
