"""Discrete-event replay of a schedule.

Model: each rank runs its actions in order on one compute lane. An action starts when its rank is free and every
input it needs (rules from :mod:`ppsim.deps`) has arrived; an input from another rank arrives ``comm`` after its
producer ends (``CostModel.comm_delay``), one from the same rank at once. Sends and receives never block compute.
An overlapped pair waits for both halves' inputs, takes the pair's duration, and both halves end together.

Engine: in-order list scheduling. ``start = max(rank free, inputs arrived)`` and ``end = start + duration`` define
every time uniquely (ranks compete for nothing but their own lane), so any visiting order that respects the
dependencies yields the same floats: the result is deterministic by construction and no ties need breaking.
The schedule is compiled once into flat arrays (per action: its duration and the one action on another rank it
waits for, in the common case, overlapped pairs included), then a tight loop advances a rank until it blocks, parks
it on the action it waits for and wakes it when that action's rank has passed it. Ranks that can never advance end
the run with :class:`~ppsim.errors.DeadlockError`. See docs/simulator.md.
"""

from __future__ import annotations

import gc
from bisect import bisect_right
from collections.abc import Callable, Iterator
from itertools import chain
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
# kind code of every action type (ActionType hashes as its str value: lookups run at C speed)
_CODE_OF = {
    t: _SINGLE_KINDS.index(t) if t in _SINGLE_KINDS else (_PAIR if t is ActionType.OVERLAP_F_B else _OTHER)
    for t in ActionType
}
_CHUNK = 1 << 16  # computations indexed and wired at once (temporaries stay cache-sized)
_COUNT_STEP = (1, -1, 0, -1)  # held activations: F adds one, B or W releases one, I releases none


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
        self._assign_waits(*self._wire_inputs())
        self._memory()

    def _read_actions(self) -> None:
        """Stage, kind and microbatch of every action and computation.

        Fields are read one per pass with list comprehensions over a flat list (CPython specialises their slot
        reads), then converted by numpy."""
        import numpy as np

        rows = self.schedule.actions
        num_ranks = len(rows)
        self.lengths = np.fromiter(map(len, rows), dtype=np.int64, count=num_ranks)
        self.offsets = np.zeros(num_ranks + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        n = self.n = int(self.offsets[-1])
        flat = list(chain.from_iterable(rows))
        self.code = np.frombuffer(bytearray([_CODE_OF[a.type] for a in flat]), dtype=np.int8)
        self.pair_idx = np.zeros(0, dtype=np.int64)  # actions that are overlapped pairs
        self.pair_first = np.zeros(0, dtype=np.int64)  # their forward halves' computation index
        self.pair_shares = np.zeros(0, dtype=np.float64)
        self.simple = n == 0 or int(self.code.max()) < _PAIR
        if self.simple:
            stage = _ints([a.stage for a in flat])
            try:
                mb = _ints([a.microbatch for a in flat])
            except TypeError:  # a computation without a microbatch: reported by _computations
                self.simple = False
        if self.simple:
            self.c_owner, self.c_stage, self.c_code, self.c_mb = np.arange(n, dtype=np.int64), stage, self.code, mb
        else:
            self.c_owner, self.c_stage, self.c_code, self.c_mb = self._computations(flat)
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

        def provided() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            """Per provided slot, chunk by chunk: the computations providing one and its key."""
            for phases in prov_phase:
                for lo in range(0, num_comps, _CHUNK):
                    part = slice(lo, lo + _CHUNK)
                    keys = self.c_stage[part] * num_mb
                    keys += self.c_mb[part]
                    keys *= num_phases
                    ph = phases[self.c_code[part]]
                    if int(ph.min(initial=0)) >= 0:
                        keys += ph
                        yield np.arange(lo, lo + len(keys)), keys
                    else:
                        sel = np.flatnonzero(ph >= 0)
                        yield sel + lo, keys[sel] + ph[sel]

        num_keys = 0
        for sel, keys in provided():
            provider[keys] = sel
            num_keys += len(sel)
        if np.count_nonzero(provider[: num_stages * num_mb * num_phases] != num_comps) != num_keys:
            for sel, keys in provided():  # a key provided twice: find it
                lost = np.flatnonzero(provider[keys] != sel)
                if len(lost):
                    self._raise_duplicate(int(sel[lost[0]]), int(keys[lost[0]]))
        self.provider = provider

    def _wire_inputs(self) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, ...]], np.ndarray]:
        """Per computation input (deps.requires): the action it waits for, the delay, and the rank crossings.

        Computations are wired in chunks, so that the temporaries stay small (cache-sized, and reused by the
        allocator instead of fresh pages). Returns the arguments of :meth:`_assign_waits`; the rank crossings go
        to ``xfer_parts``, in input-slot order."""
        import numpy as np

        schedule, costs = self.schedule, self.costs
        num_stages = schedule.num_stages
        # first action index of each action's rank; entry n (an input nobody provides) is on no rank
        lo_ext = np.repeat(np.append(self.offsets[:-1], -1), np.append(self.lengths, 1))
        owner_ext = None if self.simple else self.owner_ext
        self.positions = _chain_positions(schedule)
        self.boundary = np.array([costs.boundary_delay(schedule, s) for s in range(num_stages)] or [0.0])
        num_comps = len(self.c_owner)
        # per computation: the action it waits for (-1: none) and the delay; a second one (rare) goes to `extra`
        wait = np.full(num_comps, -1, dtype=np.int64)
        wait_delay = np.zeros(num_comps, dtype=np.float64)
        extra = []
        xfer_by_slot: list[list[tuple[np.ndarray, ...]]] = [[] for _ in self.req_stage]
        for lo in range(0, num_comps, _CHUNK):
            for slot, (w, pw, delay, xfer) in enumerate(self._wire_chunk(slice(lo, lo + _CHUNK), lo_ext, owner_ext)):
                xfer_by_slot[slot].append(xfer)
                if slot:
                    again = wait[w] >= 0
                    if again.any():
                        extra.append((w[again], pw[again], delay[again]))
                        w, pw, delay = w[~again], pw[~again], delay[~again]
                wait[w] = pw
                wait_delay[w] = delay
        self.xfer_parts = tuple(chain.from_iterable(xfer_by_slot))
        self.stage_out_bytes = np.full(num_stages + 1, np.nan)
        if costs.output_bytes is not None:
            for st in range(num_stages):
                self.stage_out_bytes[st] = costs.output_bytes[costs.position(schedule, st)]
        return wait, wait_delay, extra, lo_ext

    def _wire_chunk(
        self, part: slice, lo_ext: np.ndarray, owner_ext: np.ndarray | None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, ...]]]:
        """Per input slot, for the computations in ``part``: those that wait (computation index, action waited
        for, delay) and the rank crossings (producer, consumer, delay, upstream stage)."""
        import numpy as np

        costs, n = self.costs, self.n
        owner = self.c_owner[part]
        stage = self.c_stage[part]
        cell = stage * 4
        cell += self.c_code[part]
        mb_part = self.c_mb[part] * self.num_phases
        rank_lo = lo_ext[owner]
        for req_stage, req_phase in zip(self.req_stage, self.req_phase):
            # provider key of the input: (stage * M + mb) * P + phase = table[cell] + mb * P
            keys = (req_stage * (self.num_mb * self.num_phases) + req_phase)[cell]
            keys += mb_part
            prod = self.provider[keys]
            po = prod if owner_ext is None else owner_ext[prod]
            # same-rank inputs produced earlier in the order are free; anything else must be waited for
            w = np.flatnonzero((po >= 0) & ((po < rank_lo) | (po >= owner)))
            pw = po[w]
            cross = lo_ext[pw] != rank_lo[w]
            cross &= pw < n
            cw = w[cross]
            ps = req_stage[cell[cw]]
            if costs.p2p_alpha is None:
                delay = np.where(cross, costs.comm, 0.0)
                upstream = ps
                x_delay = np.broadcast_to(np.float64(costs.comm), (len(cw),))
            else:
                cs = stage[cw]
                upstream = np.where(self.positions[ps] < self.positions[cs], ps, cs)
                delay = np.zeros(len(w), dtype=np.float64)
                delay[cross] = self.boundary[upstream]
                x_delay = delay[cross]
            xfer = (prod[cw].astype(np.int32), (cw + part.start).astype(np.int32), x_delay, upstream.astype(np.int32))
            yield w + part.start, pw, delay, xfer

    def _assign_waits(
        self,
        wait: np.ndarray,
        wait_delay: np.ndarray,
        extra: list[tuple[np.ndarray, ...]],
        lo_ext: np.ndarray,
    ) -> None:
        """Per action: one input to wait for (``dep >= 0``), two (``dep = -3 - j``: group j), or more (``dep = -2``,
        listed in ``multi``); ``dep = -1``: nothing to wait for.

        ``wait``/``wait_delay``: per computation, the action it waits for and the delay; ``extra``: further waits
        of computations that wait for more than one action; ``lo_ext``: the first action of each action's rank."""
        import numpy as np

        empty = np.zeros(0, dtype=np.int64)
        self.group_a, self.group_b = empty, empty
        self.group_delay_a, self.group_delay_b = np.zeros(0), np.zeros(0)
        if self.simple:
            dep, dep_delay = wait, wait_delay
        else:
            dep = np.full(self.n, -1, dtype=np.int64)
            dep_delay = np.zeros(self.n, dtype=np.float64)
            dep[self.single_idx] = wait[self.single_first]
            dep_delay[self.single_idx] = wait_delay[self.single_first]
            self._pair_waits(wait, wait_delay, dep, dep_delay, lo_ext)
        multi: dict[int, list[tuple[int, float]]] = {}
        if extra:
            c_owner = self.c_owner
            actions = np.unique(c_owner[np.concatenate([w for w, _, _ in extra])])
            for c in np.flatnonzero(np.isin(c_owner, actions) & (wait >= 0)).tolist():
                multi.setdefault(int(c_owner[c]), []).append((int(wait[c]), float(wait_delay[c])))
            for w, pw, delay in extra:
                for c, p, d in zip(w.tolist(), pw.tolist(), delay.tolist()):
                    multi[int(c_owner[c])].append((p, d))
            dep[actions] = -2
        self.dep, self.dep_delay, self.multi = dep, dep_delay, multi

    def _pair_waits(
        self, wait: np.ndarray, wait_delay: np.ndarray, dep: np.ndarray, dep_delay: np.ndarray, lo_ext: np.ndarray
    ) -> None:
        """A pair waits for what either half waits for: one action, or a group of two.

        Two producers on one rank (a pair fed by one neighbour, as in DualPipe) need no group: on a rank the later
        action ends no earlier (durations are >= 0), so when its delay is no smaller it alone decides the start."""
        import numpy as np

        nonnegative = bool((self.duration >= 0.0).all())
        groups = []
        for lo in range(0, len(self.pair_idx), _CHUNK):
            first, pairs = self.pair_first[lo : lo + _CHUNK], self.pair_idx[lo : lo + _CHUNK]
            a, b = wait[first], wait[first + 1]
            da, db = wait_delay[first], wait_delay[first + 1]
            take_b = a < 0
            both = (a >= 0) & (b >= 0)
            if nonnegative and both.any():
                same = both & (lo_ext[a] == lo_ext[b]) & (a < self.n) & (b < self.n)
                b_decides = same & (a <= b) & (da <= db)
                a_decides = same & ~b_decides & (b <= a) & (db <= da)
                take_b |= b_decides
                both &= ~(a_decides | b_decides)
            dep[pairs] = np.where(take_b, b, a)
            dep_delay[pairs] = np.where(take_b, db, da)
            two = np.flatnonzero(both)
            if len(two):
                groups.append((pairs[two], a[two], b[two], da[two], db[two]))
        if groups:
            at, self.group_a, self.group_b, self.group_delay_a, self.group_delay_b = (
                np.concatenate(col) for col in zip(*groups)
            )
            dep[at] = -3 - np.arange(len(at), dtype=np.int64)

    def _durations(self) -> None:
        """One cost per (kind, stage) from the cost model; pairs through its pair rule."""
        import numpy as np

        schedule, costs = self.schedule, self.costs
        width = max(schedule.num_stages, 1)
        op = np.zeros((6, width), dtype=np.float64)
        # Runtime overheads (the profile's calibrated probe). Bridge until the sim branch's CostModel.duration, which
        # applies them (and recv_posting), is merged: take that one and drop these lines then.
        scale, dispatch = costs.compute_scale, costs.dispatch_s
        for k, kind in enumerate(_SINGLE_KINDS):
            op[k, : schedule.num_stages] = [
                costs.op_cost(schedule, s, kind) * scale + dispatch for s in range(schedule.num_stages)
            ]
        if costs.num_positions is None:
            duration = op[:, 0][self.code]  # pairs and others cost 0 here
        elif self.simple:
            duration = op[self.c_code, self.c_stage]
        else:
            duration = np.zeros(self.n, dtype=np.float64)
            at = self.single_first
            duration[self.single_idx] = op[self.c_code[at], self.c_stage[at]]
        if len(self.pair_idx):
            # evaluated once per distinct (forward stage, backward stage, backward kind)
            f = self.pair_first
            combo = self.c_stage[f] * width
            combo += self.c_stage[f + 1]
            combo *= 4
            combo += self.c_code[f + 1]
            uniq, inverse = _distinct(combo, width * width * 4)
            rule = costs.pair_split
            split = np.array(
                [rule(schedule, u // 4 // width, u // 4 % width, _SINGLE_KINDS[u % 4]) for u in uniq.tolist()],
                dtype=np.float64,
            ).reshape(-1, 2)
            if scale != 1.0 or dispatch != 0.0:  # each half: op cost x scale + dispatch
                total = split[:, 0] * scale + 2 * dispatch
                fwd = split[:, 0] * split[:, 1] * scale + dispatch
                split[:, 1] = np.divide(fwd, total, out=np.full_like(total, 0.5), where=total > 0)
                split[:, 0] = total
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

    def _computations(self, flat: list[Action]) -> tuple[np.ndarray, ...]:
        """Computation arrays for orders with pairs (or non-compute actions): singles plus both halves of pairs.

        Action ``a`` owns ``per_action[a]`` computations (single 1, pair 2, other 0) from ``c_start[a]`` on; the
        fields of singles and of halves (read in order) fill their computations through two masks, without sorting."""
        import numpy as np

        code, n = self.code, self.n
        single = np.flatnonzero(code < _PAIR)
        self.pair_idx = pair_idx = np.flatnonzero(code == _PAIR)
        pair_type = ActionType.OVERLAP_F_B
        halves = [h for a in flat if a.type is pair_type for h in a.sub_actions]
        if len(halves) != 2 * len(pair_idx):
            a = next(int(a) for a in pair_idx if len(flat[a].sub_actions) != 2)
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {flat[a]} must hold exactly two actions; "
                "write it as (sF m;sB m)OVERLAP_F_B"
            )
        per_action = (code < _PAIR).view(np.int8) + 2 * (code == _PAIR).view(np.int8)
        c_start = np.cumsum(per_action, dtype=np.int64)
        c_start -= per_action
        self.pair_first = c_start[pair_idx]
        self.single_idx, self.single_first = single, c_start[single]
        # owner of each computation, then n and -1: indexed by a provider entry, ``owner_ext`` gives the producer
        # action, n for a key nobody provides (num_comps) and -1 for no input (-1)
        self.owner_ext = np.repeat(np.arange(n + 2, dtype=np.int64), np.append(per_action, [1, 1]))
        self.owner_ext[-1] = -1
        c_owner = self.owner_ext[:-2]
        in_pair = np.repeat(code == _PAIR, per_action)
        in_single = ~in_pair
        singles = [flat[i] for i in single.tolist()]
        c_stage = np.empty(len(c_owner), dtype=np.int64)
        c_code = np.empty(len(c_owner), dtype=np.int8)
        c_mb = np.empty(len(c_owner), dtype=np.int64)
        c_stage[in_single] = _ints([a.stage for a in singles])
        c_code[in_single] = code[single]
        c_mb[in_single] = self._microbatches(singles, lambda k: int(single[k]))
        c_stage[in_pair] = _ints([h.stage for h in halves])
        c_mb[in_pair] = self._microbatches(halves, lambda k: int(pair_idx[k // 2]))
        half_types = [h.type for h in halves]
        half_code = np.empty(len(halves), dtype=np.int8)
        for half in (0, 1):
            half_code[half::2] = _kind_codes(half_types[half::2])
        c_code[in_pair] = half_code
        return c_owner, c_stage, c_code, c_mb

    def _microbatches(self, comps: list[Action], owner_of: Callable[[int], int]) -> np.ndarray:
        """Microbatch of each computation; one without (``comps[k]``, in action ``owner_of(k)``) is an error."""
        try:
            return _ints([c.microbatch for c in comps])
        except TypeError:
            a = owner_of(next(k for k, c in enumerate(comps) if c.microbatch is None))
            raise ScheduleFormatError(
                f"rank {self.rank_of(a)} position {self.position_of(a)}: {self.action_at(a)} has no microbatch; "
                "write computations as [stage][type][microbatch], e.g. 2F0"
            ) from None

    def _per_action(self, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Net change and positive part per action of a per-computation step."""
        import numpy as np

        if self.simple:
            return step, np.maximum(step, 0)
        delta = np.zeros(self.n, dtype=step.dtype)
        plus = np.zeros(self.n, dtype=step.dtype)
        first = self.pair_first
        for out, part in ((delta, step), (plus, np.maximum(step, 0))):
            out[self.single_idx] = part[self.single_first]
            out[self.pair_idx] = part[first] + part[first + 1]
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


def _distinct(values: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """``numpy.unique(values, return_inverse=True)`` for values in ``[0, bound)``; a table, not a sort, when the
    bound is small."""
    import numpy as np

    if bound > 4 * len(values) + 4096:
        return np.unique(values, return_inverse=True)
    seen = np.zeros(bound, dtype=bool)
    seen[values] = True
    uniq = np.flatnonzero(seen)
    index = np.zeros(bound, dtype=np.int64)
    index[uniq] = np.arange(len(uniq))
    return uniq, index[values]


def _ints(values: list[int]) -> np.ndarray:
    """An int64 array from a list of ints (a list comprehension plus this beats a generator into ``fromiter``)."""
    import numpy as np

    return np.fromiter(values, dtype=np.int64, count=len(values))


def _kind_codes(types: list[ActionType]) -> np.ndarray:
    """Kind codes of action types; a list of one kind only (every forward half) is counted, not mapped."""
    import numpy as np

    if types and types.count(types[0]) == len(types):
        return np.full(len(types), _CODE_OF[types[0]], dtype=np.int8)
    return np.frombuffer(bytearray([_CODE_OF[t] for t in types]), dtype=np.int8)


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
    prov_phase = [np.full(6, -1, dtype=np.int8) for _ in range(max(len(p) for p in provs))]
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
    # memoryviews read the compiled arrays in place, item by item, as Python numbers
    dep = memoryview(prog.dep)
    delay: Any = memoryview(prog.dep_delay)
    if prog.costs.p2p_alpha is None:
        # a flat comm: every input the loop gets past arrives `comm` after its producer (an input it waits for on
        # its own rank lies later there, so that action never runs), and one shared float serves every action
        delay = [float(prog.costs.comm)] * n
    dur = memoryview(prog.duration)
    multi = prog.multi
    ga, gb = memoryview(prog.group_a), memoryview(prog.group_b)
    gda, gdb = memoryview(prog.group_delay_a), memoryview(prog.group_delay_b)
    offsets = prog.offsets.tolist()
    num_ranks = len(offsets) - 1
    # rank of each action; action n (an input nobody computes) gets an extra rank that never runs
    rank_of = memoryview(np.repeat(np.arange(num_ranks + 1, dtype=np.int64), np.append(prog.lengths, 1)))
    # -1: not yet; slot n stands for an input no rank computes. A list, not an array: reading a float back from a
    # list allocates nothing, and the loop reads ends of other ranks at random
    end = [-1.0] * (n + 1)
    ptr = offsets[:-1]
    stops = offsets[1:]
    clock = [0.0] * num_ranks
    need = [0] * num_ranks  # per parked rank: the action it waits for
    parked: list[list[int]] = [[] for _ in range(num_ranks + 1)]  # per rank: ranks waiting for one of its actions
    ready = list(range(num_ranks - 1, -1, -1))
    pop = ready.pop
    push = ready.append
    r = pop() if ready else -1
    while r >= 0:
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
        if i < stop:
            need[r] = d
            parked[rank_of[d]].append(r)
        # wake the ranks waiting for an action this rank has passed; the first one runs next
        waiting = parked[r]
        q, r = r, -1
        if waiting:
            if len(waiting) == 1:
                if need[waiting[0]] < i:
                    r = waiting.pop()
            else:
                still = []
                for w in waiting:
                    if need[w] < i:
                        push(w)
                    else:
                        still.append(w)
                parked[q] = still
        if r < 0 and ready:
            r = pop()
    stuck = [r for r in range(num_ranks) if ptr[r] < stops[r]]
    if stuck:
        _raise_deadlock(prog, end, stuck, ptr)
    return np.fromiter(end, dtype=np.float64, count=n)


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

    # a pair's forward half is drawn first, in its cost share
    pair_mid = start[prog.pair_idx] + duration[prog.pair_idx] * prog.pair_shares

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
        comp_owner=prog.c_owner,
        comp_stage=prog.c_stage,
        comp_type=prog.c_code,
        comp_mb=prog.c_mb,
        pair_first=prog.pair_first,
        pair_mid=pair_mid,
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
