"""Discrete-event replay of a schedule: a compile step and an engine.

Model: each rank runs its actions in order on one compute lane. An action starts when its rank is free and every
input it needs (rules from :mod:`ppsim.deps`) has arrived; an input from another rank arrives
``StageCosts.comm_delay`` after it is posted, one from the same rank at once. A hand-off is posted when its producer
ends (``recv_posting="early"``) or, with ``recv_posting="consumer"``, at the later of that and the end of the
consumer rank's previous action. Sends and receives never block compute. An overlapped pair waits for both halves'
inputs, takes the pair's duration, and both halves end together.

:func:`compile_schedule` turns the schedule into a :class:`Program`: flat arrays holding, per action, its duration
(``StageCosts.duration``) and at most two inputs (the action each waits for, and the delay), for single computations
and overlapped pairs alike. :func:`run` is the engine: in-order list scheduling. ``start = max(rank free, inputs
arrived)`` and ``end = start + duration`` define every time uniquely (ranks compete for nothing but their own lane),
so any visiting order that respects the dependencies yields the same floats: the result is deterministic by
construction and no ties need breaking. It advances a rank until it blocks, parks it on the action it waits for and
wakes it when that action's rank has passed it; ranks that can never advance end the run with
:class:`~ppsim.errors.DeadlockError`. See docs/simulator.md.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ppsim import deps
from ppsim.costs import ACTIVATION_PARTS, CostSpec, StageCosts, parse_costs
from ppsim.errors import CostError, DeadlockError, ScheduleFormatError
from ppsim.io import MemoryCap
from ppsim.ir import Action, ActionType, Schedule, make_action, overlap
from ppsim.limits import MAX_COST
from ppsim.result import RankStats, SimResult, Trace, peaks_of, safe_ratio

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_KINDS = (ActionType.F, ActionType.B, ActionType.I, ActionType.W)  # computation codes 0..3
_PAIR = 4
_OTHER = 5  # SEND/RECV/UNSHARD/...: no compute, no inputs, zero time
# kind code of every action type (ActionType hashes as its str value: lookups run at C speed)
_CODE_OF = {
    t: _KINDS.index(t) if t in _KINDS else (_PAIR if t is ActionType.OVERLAP_F_B else _OTHER) for t in ActionType
}
_NUM_COMPS = np.array([1, 1, 1, 1, 2, 0], dtype=np.int64)  # computations per action, by code
_CHUNK = 1 << 16  # computations wired at once (temporaries stay cache-sized)
_COUNT_STEP = (1, -1, 0, -1)  # held activations: F adds one, B or W releases one, I releases none
_MAX_DEADLOCK_PARTS = 12  # ranks named in a deadlock message (err.blocked holds them all)


def simulate(
    schedule: Schedule,
    costs: StageCosts | CostSpec | None = None,
    *,
    memory_cap_bytes: int | None = None,
    memory_cap: MemoryCap | None = None,
    recompute: Set[tuple[int, int]] | None = None,
    extra_s: Mapping[tuple[int, int], float] | None = None,
) -> SimResult:
    """Replay ``schedule`` under ``costs`` (default: ``parse_costs(None)``) and return the timed result.

    ``costs``: the simulator's :class:`StageCosts`, or a :class:`CostSpec` (what the user gave), read for this
    schedule once by :meth:`CostSpec.for_schedule`.

    ``recompute``: the (stage, microbatch) pairs whose activations are recomputed (:mod:`ppsim.recompute`): each
    keeps only its boundary input after its F, and its B/I runs the forward again first.
    ``memory_cap`` (bytes or activations, :func:`ppsim.io.parse_memory_cap`) flags the ranks over it;
    ``memory_cap_bytes`` is the same for a cap in bytes. ``extra_s``: time added to the action at (rank, position),
    in the cost unit (FSDP's exposed collectives, :mod:`ppsim.step.fsdp`)."""
    assert memory_cap is None or memory_cap_bytes is None, "give the cap once"
    if memory_cap_bytes is not None:
        memory_cap = MemoryCap(memory_cap_bytes, "bytes")
    if costs is None:
        costs = parse_costs(None)
    elif isinstance(costs, CostSpec):
        costs = costs.for_schedule(schedule)
    was_enabled = gc.isenabled()
    gc.disable()  # the run creates no reference cycles; collections would only rescan large lists
    try:
        program = compile_schedule(schedule, costs, recompute=recompute)
        for (rank, pos), seconds in (extra_s or {}).items():
            program.duration[int(program.offsets[rank]) + pos] += seconds
        start, end = run(program)
        return _finish(program, start, end, memory_cap)
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True, eq=False)
class Program:
    """A schedule compiled to flat arrays (see :func:`compile_schedule`).

    Actions are numbered rank by rank (action ``offsets[r] + pos`` is ``schedule.actions[r][pos]``). Computations
    are single F/B/I/W, numbered in action order; an overlapped pair owns two (forward half first), a
    communication action none. Every action waits for at most two other actions: ``input_a``/``input_b`` (-1: none;
    ``n``: an input no rank computes), each arriving ``delay_a``/``delay_b`` after it is posted.
    """

    schedule: Schedule
    costs: StageCosts
    offsets: np.ndarray  # (R+1,) first action of each rank
    # computations
    comp_owner: np.ndarray  # (C,) action index
    comp_stage: np.ndarray
    comp_code: np.ndarray  # index into _KINDS
    comp_mb: np.ndarray
    single_idx: np.ndarray  # actions that are one computation ...
    single_comp: np.ndarray  # ... and that computation
    pair_idx: np.ndarray  # actions that are overlapped pairs ...
    pair_first: np.ndarray  # ... and their forward halves (the backward half follows)
    pair_share: np.ndarray  # per pair: the forward half's share of its duration
    # per action
    duration: np.ndarray
    input_a: np.ndarray
    delay_a: np.ndarray
    input_b: np.ndarray
    delay_b: np.ndarray
    post_delay: np.ndarray | None  # with recv_posting="consumer": the largest delay of the action's inputs
    next_general: np.ndarray  # per action: the first action from it on (same rank) that needs the general path
    # rank-crossing hand-offs, in parts of (producer computation, consumer computation, delay)
    xfer_parts: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    stage_out_bytes: np.ndarray
    # key lookup for messages: provider[(stage * M + dense mb) * P + phase]
    provider: np.ndarray
    mb_ids: np.ndarray | None  # microbatch id of each dense index (None: ids are their own index)
    num_mb: int
    num_phases: int
    comp_recomputed: np.ndarray | None = None  # (C,) bool: the computation's (stage, microbatch) is recomputed
    recompute: frozenset[tuple[int, int]] = frozenset()

    @property
    def num_actions(self) -> int:
        return int(self.offsets[-1])

    # -- names for messages -------------------------------------------------------------------------------------

    def rank_of(self, a: int) -> int:
        return _rank_of(self.offsets, a)

    def action_at(self, a: int) -> Action:
        r = self.rank_of(a)
        return self.schedule.actions[r][a - int(self.offsets[r])]

    def comp_str(self, c: int) -> str:
        return f"{int(self.comp_stage[c])}{_KINDS[int(self.comp_code[c])].value}{int(self.comp_mb[c])}"

    def producer_of(self, key: deps.Key) -> int:
        """Computation index providing ``key``; -1 when none does."""
        s, mb, phase = key
        if self.mb_ids is not None:
            k = int(np.searchsorted(self.mb_ids, mb))
            mb = k if k < len(self.mb_ids) and int(self.mb_ids[k]) == mb else -1
        if not (0 <= s < self.schedule.num_stages and 0 <= mb < self.num_mb):
            return -1
        c = int(self.provider[(s * self.num_mb + mb) * self.num_phases + phase])
        return c if c < len(self.comp_owner) else -1


# -- compile ----------------------------------------------------------------------------------------------------


def compile_schedule(
    schedule: Schedule, costs: StageCosts, *, recompute: Set[tuple[int, int]] | None = None
) -> Program:
    """The schedule as flat arrays: computations, durations, and per action the (at most two) inputs to wait for.

    Inputs come from :mod:`ppsim.deps` (tabulated per stage and kind), durations from ``StageCosts.duration`` (once
    per stage and kind, and once per distinct pair), delays from ``StageCosts.comm_delay`` (once per stage, kind and
    input). A same-rank input produced earlier in the order is dropped: the lane order already implies it.
    """
    costs.check(schedule)
    offsets = np.zeros(schedule.num_ranks + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, schedule.actions), dtype=np.int64, count=schedule.num_ranks), out=offsets[1:])
    try:
        comps = read_computations(schedule, offsets)
    except OverflowError:  # a stage or microbatch id beyond 64 bits
        a = next(
            i
            for i, action in enumerate(chain.from_iterable(schedule.actions))
            if any(not (-(2**63) <= v < 2**63) for c in action.computations for v in (c.stage, c.microbatch or 0))
        )
        raise ScheduleFormatError(
            f"{_where(schedule, offsets, a)}: {_action_at(schedule, offsets, a)} has an id beyond 64 bits; number "
            "stages and microbatches from 0"
        ) from None
    c_owner, c_stage, c_code, c_mb, single_idx, single_comp, pair_idx, pair_first = comps
    num_stages = schedule.num_stages
    if len(c_stage) and (int(c_stage.min()) < 0 or int(c_stage.max()) >= num_stages or int(c_mb.min()) < 0):
        bad = int(np.flatnonzero((c_stage < 0) | (c_stage >= num_stages) | (c_mb < 0))[0])
        a = int(c_owner[bad])
        raise ScheduleFormatError(
            f"{_where(schedule, offsets, a)}: {_action_at(schedule, offsets, a)} needs a stage in "
            f"0..{num_stages - 1} and a microbatch >= 0; fix the action"
        )
    recomputed = _recomputed(c_stage, c_mb, recompute) if recompute else None
    duration, pair_share = _durations(schedule, costs, offsets, comps, recomputed)
    rules = _Rules(schedule, costs)
    mb_dense, mb_ids = _dense_microbatches(c_mb)
    num_mb = int(mb_dense.max()) + 1 if len(mb_dense) else 1
    provider = _index_providers(schedule, offsets, comps, rules, mb_dense, num_mb)
    wiring = _wire(schedule, offsets, comps, rules, mb_dense, num_mb, provider, duration)
    input_a, delay_a, input_b, delay_b, xfer_parts = wiring
    post_delay = None
    if costs.recv_posting == "consumer":
        post_delay = np.where(input_a >= 0, delay_a, 0.0)
        np.maximum(post_delay, np.where(input_b >= 0, delay_b, 0.0), out=post_delay)
    elif costs.recv_posting != "early":
        raise CostError(f"recv_posting {costs.recv_posting!r} is unknown; use 'early' or 'consumer'")
    # the engine's general path: a second input, or a hand-off posted by the consumer; the rest take the fast path
    general = np.flatnonzero((input_b >= 0) | ((input_a >= 0) & (post_delay is not None)))
    rank_stop = np.repeat(offsets[1:], np.diff(offsets))
    if len(general):
        first_general = np.append(general, int(offsets[-1]))[np.searchsorted(general, np.arange(len(rank_stop)))]
        next_general = np.minimum(first_general, rank_stop)
    else:
        next_general = rank_stop
    stage_out_bytes = np.full(num_stages + 1, np.nan)
    if costs.output_bytes is not None:
        for st in range(num_stages):
            stage_out_bytes[st] = costs.output_bytes[costs.position(schedule, st)]
    return Program(
        schedule=schedule,
        costs=costs,
        offsets=offsets,
        comp_owner=c_owner,
        comp_stage=c_stage,
        comp_code=c_code,
        comp_mb=c_mb,
        single_idx=single_idx,
        single_comp=single_comp,
        pair_idx=pair_idx,
        pair_first=pair_first,
        pair_share=pair_share,
        duration=duration,
        input_a=input_a,
        delay_a=delay_a,
        input_b=input_b,
        delay_b=delay_b,
        post_delay=post_delay,
        next_general=next_general,
        xfer_parts=xfer_parts,
        stage_out_bytes=stage_out_bytes,
        provider=provider,
        mb_ids=mb_ids,
        num_mb=num_mb,
        num_phases=rules.num_phases,
        comp_recomputed=recomputed,
        recompute=frozenset() if recomputed is None else frozenset(recompute or ()),
    )


def _recomputed(c_stage: np.ndarray, c_mb: np.ndarray, recompute: Set[tuple[int, int]]) -> np.ndarray | None:
    """Per computation: whether its (stage, microbatch) is in ``recompute`` (None when none is)."""
    pairs = np.array(sorted(recompute), dtype=np.int64).reshape(-1, 2)
    width = int(max(int(c_mb.max(initial=0)), int(pairs[:, 1].max(initial=0)))) + 1
    keys = pairs[:, 0] * width + pairs[:, 1]
    flag = np.isin(c_stage * width + c_mb, keys)
    return flag if flag.any() else None


_Comps = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def read_computations(schedule: Schedule, offsets: np.ndarray) -> _Comps:
    """Per computation its owner action, stage, kind code and microbatch; which actions are singles and pairs.

    Fields are read one per pass with list comprehensions over a flat list (CPython specialises their slot reads),
    then converted by numpy; pair halves are read the same way and placed after their owner's forward half."""
    flat = list(chain.from_iterable(schedule.actions))
    n = len(flat)
    code = np.frombuffer(bytearray([_CODE_OF[a.type] for a in flat]), dtype=np.int8)
    per_action = _NUM_COMPS[code]
    comp_start = np.cumsum(per_action)
    comp_start -= per_action
    num_comps = int(per_action.sum())
    single_idx = np.flatnonzero(code < _PAIR)
    pair_idx = np.flatnonzero(code == _PAIR)
    singles = flat if len(single_idx) == n else [flat[i] for i in single_idx.tolist()]
    pair_type = ActionType.OVERLAP_F_B
    halves = [h for a in flat if a.type is pair_type for h in a.sub_actions] if len(pair_idx) else []
    if len(halves) != 2 * len(pair_idx):
        a = next(int(a) for a in pair_idx.tolist() if len(flat[a].sub_actions) != 2)
        raise ScheduleFormatError(
            f"{_where(schedule, offsets, a)}: {flat[a]} must hold exactly two actions; write it as "
            "(sF m;sB m)OVERLAP_F_B"
        )
    if len(single_idx) == n:  # one computation per action: one index array serves as all three
        single_comp = c_owner = single_idx
    else:
        single_comp = comp_start[single_idx]
        c_owner = np.repeat(np.arange(n, dtype=np.int64), per_action)
    pair_first = comp_start[pair_idx]
    if len(pair_idx) == 0:  # every computation is a single: the arrays are read in place
        c_stage = _ints([a.stage for a in singles])
        c_code = code[single_idx] if len(single_idx) != n else code
        c_mb = _microbatches(schedule, offsets, singles, single_idx)
        return c_owner, c_stage, c_code, c_mb, single_idx, single_comp, pair_idx, pair_first
    c_stage = np.empty(num_comps, dtype=np.int64)
    c_code = np.empty(num_comps, dtype=np.int8)
    c_mb = np.empty(num_comps, dtype=np.int64)
    c_stage[single_comp] = _ints([a.stage for a in singles])
    c_code[single_comp] = code[single_idx]
    c_mb[single_comp] = _microbatches(schedule, offsets, singles, single_idx)
    for half in (0, 1):
        part = halves[half::2]
        c_stage[pair_first + half] = _ints([h.stage for h in part])
        c_code[pair_first + half] = _kind_codes([h.type for h in part])
        c_mb[pair_first + half] = _microbatches(schedule, offsets, part, pair_idx)
    return c_owner, c_stage, c_code, c_mb, single_idx, single_comp, pair_idx, pair_first


def _microbatches(schedule: Schedule, offsets: np.ndarray, comps: list[Action], owners: np.ndarray) -> np.ndarray:
    """Microbatch of each computation; one without (``comps[k]``, in action ``owners[k]``) is an error."""
    try:
        return _ints([c.microbatch for c in comps])
    except TypeError:
        a = int(owners[next(k for k, c in enumerate(comps) if c.microbatch is None)])
        raise ScheduleFormatError(
            f"{_where(schedule, offsets, a)}: {_action_at(schedule, offsets, a)} has no microbatch; write "
            "computations as [stage][type][microbatch], e.g. 2F0"
        ) from None


def _durations(
    schedule: Schedule, costs: StageCosts, offsets: np.ndarray, comps: _Comps, recomputed: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per action its duration (``StageCosts.duration``, evaluated once per stage, kind and recompute flag and once
    per distinct pair of stages), and per pair its forward half's share (``StageCosts.pair_split``, or
    ``StageCosts.recompute_share`` when its backward half recomputes)."""
    c_owner, c_stage, c_code, _, single_idx, single_comp, pair_idx, pair_first = comps
    width = max(schedule.num_stages, 1)
    n = int(offsets[-1])
    flags = (False,) if recomputed is None else (False, True)
    if costs.num_positions is None:  # uniform costs: one value per kind
        table = np.array([[costs.duration(schedule, Action(0, kind, 0), recomputed=rc) for kind in _KINDS]
                          for rc in flags])
        rows = 0 if recomputed is None else recomputed[single_comp].astype(np.int64)
        single = table[rows, c_code[single_comp]]
    else:
        table = np.array(
            [[[costs.duration(schedule, Action(s, kind, 0), recomputed=rc) for s in range(schedule.num_stages)]
              for kind in _KINDS] for rc in flags]
        ).reshape(len(flags), len(_KINDS), -1)
        rows = 0 if recomputed is None else recomputed[single_comp].astype(np.int64)
        single = table[rows, c_code[single_comp], c_stage[single_comp]]
    duration = np.zeros(n, dtype=np.float64)
    duration[single_idx] = single
    share = np.zeros(len(pair_idx), dtype=np.float64)
    if len(pair_idx):
        combo = c_stage[pair_first] * width
        combo += c_stage[pair_first + 1]
        combo *= 4
        combo += c_code[pair_first + 1]
        combo *= 2
        if recomputed is not None:
            combo += recomputed[pair_first + 1]
        uniq, inverse = _distinct(combo, width * width * 8)
        split = []
        for u in uniq.tolist():
            rc, u = bool(u % 2), u // 2
            f_stage, b_stage, kind = u // 4 // width, u // 4 % width, _KINDS[u % 4]
            pair = overlap(Action(f_stage, ActionType.F, 0), Action(b_stage, kind, 0))
            if rc:
                f_share = costs.recompute_share(schedule, f_stage, b_stage, kind)
            else:
                f_share = costs.pair_split(schedule, f_stage, b_stage, kind)[1]
            split.append((costs.duration(schedule, pair, recomputed=rc), f_share))
        table2 = np.array(split, dtype=np.float64).reshape(-1, 2)
        duration[pair_idx] = table2[inverse, 0]
        share = table2[inverse, 1]
    if len(duration) and not _within_limit(duration).all():
        a = int(np.flatnonzero(~_within_limit(duration))[0])
        _refuse_non_finite(costs, f"{_action_at(schedule, offsets, a)} takes {float(duration[a]):g}")
    return duration, share


class _Rules:
    """:mod:`ppsim.deps` and ``StageCosts.comm_delay`` tabulated over ``cell = stage * 4 + kind``.

    Per input slot: the required stage (S for no input), phase and delay; per provided slot a table over kind of
    the provided phase (-1 for none). The simulator relies on two facts of the rules, checked here: an input has
    the consumer's microbatch, and at most one input of a computation comes from another stage."""

    def __init__(self, schedule: Schedule, costs: StageCosts) -> None:
        num_stages = schedule.num_stages
        requires, rank = deps.requires, schedule.stage_to_rank
        reqs = [requires(schedule, make_action(s, kind, 1)) for s in range(num_stages) for kind in _KINDS]
        width = max(map(len, reqs), default=0)
        cells = max(len(reqs), 1)
        stages = [[num_stages] * cells for _ in range(width)]
        phases = [[0] * cells for _ in range(width)]
        delays = [[0.0] * cells for _ in range(width)]
        delay_of: dict[tuple[int, int], float] = {}  # (producer stage, consumer stage) -> StageCosts.comm_delay
        for i, got in enumerate(reqs):
            consumer = i // 4
            assert len(got) < 2 or (len(got) == 2 and consumer in (got[0][0], got[1][0])), "one input from elsewhere"
            for j, (st, mb, ph) in enumerate(got):
                assert mb == 1, "the simulator assumes inputs of the same microbatch"
                stages[j][i] = st
                phases[j][i] = ph
                if rank[st] != rank[consumer]:
                    d = delay_of.get((st, consumer))
                    if d is None:
                        d = delay_of[(st, consumer)] = costs.comm_delay(schedule, st, consumer)
                    delays[j][i] = d
        self.req_stage = [np.array(col, dtype=np.int64) for col in stages]
        self.req_phase = [np.array(col, dtype=np.int64) for col in phases]
        self.req_delay = [np.array(col, dtype=np.float64) for col in delays]
        for col in self.req_delay:
            if not _within_limit(col).all():
                i = int(np.flatnonzero(~_within_limit(col))[0])
                _refuse_non_finite(costs, f"a hand-off to stage {i // 4} takes {float(col[i]):g}")
        provs: list[list[int]] = []
        for kind in _KINDS:
            made = deps.provides(Action(0, kind, 1))
            assert all(k[0] == 0 and k[1] == 1 for k in made), "a computation provides its own keys"
            provs.append([k[2] for k in made])
        self.prov_phase = [np.full(6, -1, dtype=np.int8) for _ in range(max(len(p) for p in provs))]
        for k, made_phases in enumerate(provs):
            for j, ph in enumerate(made_phases):
                self.prov_phase[j][k] = ph
        self.num_phases = 1 + max([ph for p in provs for ph in p] + [k[2] for r in reqs for k in r])


def _dense_microbatches(c_mb: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Microbatch ids as indices into tables sized by the number of computations, not by the largest id."""
    if not len(c_mb) or int(c_mb.max()) < 4 * len(c_mb) + 4096:
        return c_mb, None
    ids, dense = np.unique(c_mb, return_inverse=True)
    return dense.astype(np.int64), ids


def _index_providers(
    schedule: Schedule, offsets: np.ndarray, comps: _Comps, rules: _Rules, mb: np.ndarray, num_mb: int
) -> np.ndarray:
    """``provider[(stage * M + mb) * P + phase]``: the computation that makes each key (deps.provides); C marks a
    key nobody provides, and the extra stage S (no input) maps to -1."""
    c_owner, c_stage, c_code = comps[0], comps[1], comps[2]
    num_stages, num_phases, num_comps = schedule.num_stages, rules.num_phases, len(c_owner)
    index_type = np.int32 if num_comps < 2**31 - 1 else np.int64
    provider = np.full((num_stages + 1) * num_mb * num_phases, num_comps, dtype=index_type)
    provider[num_stages * num_mb * num_phases :] = -1

    def provided() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Per provided slot, chunk by chunk: the computations providing one and its key."""
        for phases in rules.prov_phase:
            for lo in range(0, num_comps, _CHUNK):
                part = slice(lo, lo + _CHUNK)
                keys = c_stage[part] * num_mb
                keys += mb[part]
                keys *= num_phases
                ph = phases[c_code[part]]
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
                comp, key = int(sel[lost[0]]), int(keys[lost[0]])
                phase, rest = key % num_phases, key // num_phases
                what = f"{rest // num_mb}{('F', 'B/I', 'W')[phase]}{int(comps[3][comp])}"
                a = int(c_owner[comp])
                raise ScheduleFormatError(
                    f"{_where(schedule, offsets, a)}: {_action_at(schedule, offsets, a)} computes {what} a second "
                    "time; each (stage, microbatch) needs exactly one F and one B (or one I and one W)"
                )
    return provider


def _wire(
    schedule: Schedule,
    offsets: np.ndarray,
    comps: _Comps,
    rules: _Rules,
    mb: np.ndarray,
    num_mb: int,
    provider: np.ndarray,
    duration: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]]:
    """Per action the inputs to wait for (``input_a``/``input_b`` and their delays), and the rank crossings.

    Each computation waits for at most one action: its input from another stage (on another rank, or later on its
    own), or a same-stage input that is not earlier on its rank (which can never arrive in time: a deadlock).
    A single takes its computation's; a pair both halves'. When both come from one rank (DualPipe: a pair is fed
    by one neighbour) only the later producer is kept, provided its delay is no smaller: on a lane ends never
    decrease (durations are >= 0), so that input alone decides the start, float for float, and a blocked pair is
    blocked either way."""
    c_owner, c_stage, c_code, _, single_idx, single_comp, pair_idx, pair_first = comps
    n, num_comps = int(offsets[-1]), len(c_owner)
    lengths = np.diff(offsets)
    # first action of each action's rank; entry n (an input nobody provides) is on no rank
    rank_lo = np.repeat(np.append(offsets[:-1], -1), np.append(lengths, 1))
    owner_ext = np.append(c_owner, [n, -1])  # provider entry -> producer action (C: nobody -> n; -1: no input)
    wait = np.full(num_comps, -1, dtype=np.int64)
    wait_delay = np.zeros(num_comps, dtype=np.float64)
    xfers: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in rules.req_stage]
    step = num_mb * rules.num_phases
    for lo in range(0, num_comps, _CHUNK):
        part = slice(lo, lo + _CHUNK)
        owner = c_owner[part]
        cell = c_stage[part] * 4
        cell += c_code[part]
        mb_part = mb[part] * rules.num_phases
        own_lo = rank_lo[owner]
        slots = zip(rules.req_stage, rules.req_phase, rules.req_delay)
        for slot, (req_stage, req_phase, req_delay) in enumerate(slots):
            keys = (req_stage * step + req_phase)[cell]
            keys += mb_part
            prod = provider[keys]
            po = owner_ext[prod]
            # same-rank inputs produced earlier in the order are free; anything else must be waited for
            w = np.flatnonzero((po >= 0) & ((po < own_lo) | (po >= owner)))
            pw = po[w]
            cross = rank_lo[pw] != own_lo[w]
            cross &= pw < n
            delay = req_delay[cell[w]]
            delay[~cross] = 0.0
            if slot:  # a blocking same-stage input (never arriving) wins over the input from another stage
                keep = (wait[w + lo] < 0) | ~cross
                w, pw, delay, cross = w[keep], pw[keep], delay[keep], cross[keep]
            wait[w + lo] = pw
            wait_delay[w + lo] = delay
            cw = np.flatnonzero(cross)
            xfers[slot].append((prod[w[cw]].astype(np.int32), (w[cw] + lo).astype(np.int32), delay[cw]))
    if len(single_idx) == n:  # every action is one computation: the arrays are the per-action ones
        input_a, delay_a = wait, wait_delay
    else:
        input_a = np.full(n, -1, dtype=np.int64)
        delay_a = np.zeros(n, dtype=np.float64)
        input_a[single_idx] = wait[single_comp]
        delay_a[single_idx] = wait_delay[single_comp]
    if not len(pair_idx):  # only pairs can wait for two actions: a read-only view of "none" costs no memory
        empty_b = np.broadcast_to(np.int64(-1), (n,)), np.broadcast_to(np.float64(0.0), (n,))
        return input_a, delay_a, empty_b[0], empty_b[1], tuple(chain.from_iterable(xfers))
    input_b = np.full(n, -1, dtype=np.int64)
    delay_b = np.zeros(n, dtype=np.float64)
    a, b = wait[pair_first], wait[pair_first + 1]
    da, db = wait_delay[pair_first], wait_delay[pair_first + 1]
    take_b = a < 0  # the forward half needs nothing: the backward half's input alone
    both = (a >= 0) & (b >= 0)
    if bool((duration >= 0.0).all()):
        same = both & (rank_lo[a] == rank_lo[b]) & (a < n) & (b < n)
        b_decides = same & (a <= b) & (da <= db)
        a_decides = same & ~b_decides & (b <= a) & (db <= da)
        take_b |= b_decides
        both &= ~(a_decides | b_decides)
    input_a[pair_idx] = np.where(take_b, b, a)
    delay_a[pair_idx] = np.where(take_b, db, da)
    input_b[pair_idx] = np.where(both, b, -1)
    delay_b[pair_idx] = np.where(both, db, 0.0)
    xfer_parts = tuple(chain.from_iterable(xfers))
    return input_a, delay_a, input_b, delay_b, xfer_parts


def _positions(schedule: Schedule) -> np.ndarray:
    """Per stage its position in its chain (entry S: 0)."""
    pos = np.zeros(max(schedule.num_stages, 1) + 1, dtype=np.int64)
    for chain_ in schedule.pipelines:
        pos[list(chain_)] = np.arange(len(chain_))
    return pos


# -- engine -----------------------------------------------------------------------------------------------------


def run(program: Program) -> tuple[np.ndarray, np.ndarray]:
    """The engine: start and end of every action (raises DeadlockError when ranks are stuck)."""
    n = program.num_actions
    offsets = program.offsets.tolist()
    num_ranks = len(offsets) - 1
    # memoryviews read the compiled arrays in place, item by item, as Python numbers
    input_a, input_b = _view(program.input_a), _view(program.input_b)
    delay_a: Sequence[float] = _view(program.delay_a)
    delay_b: Sequence[float] = _view(program.delay_b)
    if program.costs.p2p_alpha is None and program.post_delay is None and not program.costs.rank_links:
        # a flat comm: every input the engine gets past comes from another rank and arrives `comm` after its
        # producer (one on the same rank lies later there, so that action never runs): one shared float
        delay_a = delay_b = [float(program.costs.comm)] * n
    dur = _view(program.duration)
    next_general = _view(program.next_general)
    consumer_posting = program.post_delay is not None
    post = _view(program.post_delay) if program.post_delay is not None else dur
    # rank of each action; action n (an input nobody computes) gets an extra rank that never runs
    rank_of = _view(np.repeat(np.arange(num_ranks + 1, dtype=np.int64), np.append(np.diff(program.offsets), 1)))
    # -1: not yet; slot n stands for an input no rank computes. A list, not an array: reading a float back from a
    # list allocates nothing, and the loop reads ends of other ranks at random
    end = [-1.0] * (n + 1)
    starts = np.empty(n, dtype=np.float64)
    start = _view(starts)  # written once per action, in place
    ptr = offsets[:-1].copy()
    stops = offsets[1:]
    firsts = offsets[:-1]
    need = [0] * num_ranks  # per parked rank: the action it waits for
    parked: list[list[int]] = [[] for _ in range(num_ranks + 1)]  # per rank: ranks waiting for one of its actions
    ready = list(range(num_ranks - 1, -1, -1))
    pop = ready.pop
    push = ready.append
    r = pop() if ready else -1
    while r >= 0:
        i = ptr[r]
        stop = stops[r]
        t = end[i - 1] if i > firsts[r] else 0.0  # the rank is free when its previous action ends
        d = -1
        while i < stop:
            # fast path: actions with at most one input, posted when its producer ends
            lim = next_general[i]
            while i < lim:
                d = input_a[i]
                if d >= 0:
                    e = end[d]
                    if e < 0.0:
                        break
                    e += delay_a[i]
                    if e > t:
                        t = e
                start[i] = t
                t += dur[i]
                end[i] = t
                i += 1
            if i < lim or i == stop:
                break
            # general path: a pair waiting for two ranks, or hand-offs posted after the rank's previous action
            # (max(producer end, t) + delay = max(producer end + delay, t + delay), for the slowest input)
            s = t + post[i] if consumer_posting else t
            d = input_a[i]
            if d >= 0:
                e = end[d]
                if e < 0.0:
                    break
                e += delay_a[i]
                if e > s:
                    s = e
            d = input_b[i]
            if d >= 0:
                e = end[d]
                if e < 0.0:
                    break
                e += delay_b[i]
                if e > s:
                    s = e
            start[i] = s
            t = s + dur[i]
            end[i] = t
            i += 1
        ptr[r] = i
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
        _raise_deadlock(program, end, stuck, ptr)
    return starts, np.fromiter(end, dtype=np.float64, count=n)


def _raise_deadlock(program: Program, end: list[float], stuck: list[int], ptr: list[int]) -> None:
    schedule = program.schedule
    blocked: dict[int, tuple[str, str]] = {}
    parts: list[str] = []
    for r in stuck:
        a = ptr[r]
        head = program.action_at(a)
        waits_for = ""
        for comp in head.computations:
            for key in deps.requires(schedule, comp):
                c = program.producer_of(key)
                if c < 0:
                    waits_for = f"{deps.describe(key)} (no rank computes it)"
                    break
                owner = int(program.comp_owner[c])
                p_rank = program.rank_of(owner)
                if end[owner] < 0.0 and not (p_rank == r and owner < a):
                    where = "later on the same rank" if p_rank == r else f"on rank {p_rank}"
                    waits_for = f"{program.comp_str(c)} ({where})"
                    break
            if waits_for:
                break
        blocked[r] = (str(head), waits_for)
        if len(parts) < _MAX_DEADLOCK_PARTS:
            parts.append(f"rank {r} at position {a - int(program.offsets[r])} ({head}) waits for {waits_for}")
    if len(stuck) > len(parts):
        parts.append(f"and {len(stuck) - len(parts)} more ranks")
    raise DeadlockError(
        f"schedule {schedule.name} deadlocks under in-order execution: "
        + "; ".join(parts)
        + "; reorder so that every input is produced earlier (check with `ppsim validate`)",
        blocked,
    )


# -- finish -----------------------------------------------------------------------------------------------------


def _per_action(program: Program, step: np.ndarray, gain: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Net change and positive part per action of a per-computation step (a pair: the sum of its halves; its
    positive part is what its forward half adds before the backward half releases). ``gain``: what each computation
    adds before it releases (default: the positive part of its step; a recomputing backward re-materialises first)."""
    n = program.num_actions
    delta = np.zeros(n, dtype=step.dtype)
    plus = np.zeros(n, dtype=step.dtype)
    pos = np.maximum(step, 0) if gain is None else gain
    first = program.pair_first
    for out, part in ((delta, step), (plus, pos)):
        out[program.single_idx] = part[program.single_comp]
        out[program.pair_idx] = part[first] + part[first + 1]
    return delta, plus


def _finish(program: Program, start: np.ndarray, end: np.ndarray, cap: MemoryCap | None) -> SimResult:
    schedule, costs = program.schedule, program.costs
    offsets = program.offsets
    num_ranks = schedule.num_ranks
    n = program.num_actions
    duration = program.duration
    makespan = float(end.max()) if n else 0.0
    if not math.isfinite(makespan):
        _refuse_non_finite(costs, f"the step's makespan is {makespan}")
    lengths = np.diff(offsets)
    nonempty = np.flatnonzero(lengths > 0)
    busy = np.zeros(num_ranks, dtype=np.float64)
    if n:
        busy[nonempty] = np.add.reduceat(duration, offsets[:-1][nonempty])
    if not np.isfinite(busy).all():
        _refuse_non_finite(costs, f"a rank is busy for {float(busy.max())}")
    # a pair's forward half is drawn first, in its cost share
    pair_mid = start[program.pair_idx] + duration[program.pair_idx] * program.pair_share
    rc = program.comp_recomputed
    kept = [costs.recompute_kept(schedule, s) for s in range(schedule.num_stages)] if rc is not None else []
    act_scale = 1 if rc is None else ACTIVATION_PARTS
    if rc is None:
        count_step = np.array(_COUNT_STEP, dtype=np.int8)[program.comp_code]
        act_delta, act_plus = _per_action(program, count_step)
    else:  # counted in parts of one activation: a recomputed one keeps a fraction
        table = np.zeros((4, max(schedule.num_stages, 1)), dtype=np.int64)
        table[:, :] = np.array(_COUNT_STEP, dtype=np.int64)[:, None] * ACTIVATION_PARTS
        act_delta, act_plus = _per_action(program, *_recompute_steps(program, table, [(ACTIVATION_PARTS, 0, p)
                                                                                     for _, p in kept]))
    byte_delta = byte_plus = None
    peak_mem = None
    if costs.has_memory:
        table = np.zeros((4, max(schedule.num_stages, 1)), dtype=np.int64)
        held_of = [costs.activation_of(schedule, s) for s in range(schedule.num_stages)]
        _refuse_int64_bytes(program, costs, held_of, schedule)
        for s, (held, freed_by_i) in enumerate(held_of):
            table[:, s] = (held, -held, -freed_by_i, -(held - freed_by_i))
        if costs.outputs_held_to_backward and costs.output_bytes is not None:
            for s in range(schedule.num_stages - 1):  # the runtime's copy of the output, F to B or I
                out = costs.output_bytes[costs.position(schedule, s)]
                table[:, s] += (out, -out, -out, 0)
        if rc is None:
            byte_delta, byte_plus = _per_action(program, table[program.comp_code, program.comp_stage])
        else:
            sizes = [(held, freed, k) for (held, freed), (k, _) in zip(held_of, kept)]
            byte_delta, byte_plus = _per_action(program, *_recompute_steps(program, table, sizes))
        peak_mem = peaks_of(byte_delta, byte_plus, offsets)
    peak_act = [p // act_scale if p % act_scale == 0 else p / act_scale for p in peaks_of(act_delta, act_plus, offsets)]
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
                over_memory_cap=cap is not None
                and cap.exceeded_by(peak_activations=peak_act[r], peak_bytes=peak_bytes),
            )
        )
    total_busy = float(busy.sum())
    bubble = 1.0 - total_busy / (num_ranks * makespan) if makespan > 0 and num_ranks else 0.0
    trace = Trace(
        offsets=offsets,
        start=start,
        end=end,
        act_delta=act_delta,
        act_plus=act_plus,
        byte_delta=byte_delta,
        byte_plus=byte_plus,
        static_bytes=tuple(static),
        comp_owner=program.comp_owner,
        comp_stage=program.comp_stage,
        comp_type=program.comp_code,
        comp_mb=program.comp_mb,
        pair_first=program.pair_first,
        pair_mid=pair_mid,
        xfer_parts=program.xfer_parts,
        stage_out_bytes=program.stage_out_bytes,
        stage_position=_positions(schedule),
        consumer_posting=program.post_delay is not None,
        act_scale=act_scale,
        comp_recomputed=rc,
        recompute_mid=None if rc is None else _recompute_mid(program, start),
    )
    return SimResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        bubble_ratio=bubble,
        throughput=safe_ratio(schedule.num_microbatches, makespan),
        per_rank=tuple(stats),
        memory_cap_bytes=None if cap is None else cap.bytes,
        trace=trace,
        recompute=program.recompute,
    )


def _recompute_steps(
    program: Program, table: np.ndarray, sizes: list[tuple[int, int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """Per computation its step and its gain (what it adds before it releases) with recomputation.

    ``table[kind, stage]`` is the plain step; ``sizes[stage]`` is ``(held, freed by I, kept)``. A recomputed
    (stage, microbatch) adds only ``kept`` at its F; its B or I first re-materialises ``held - kept`` (the gain),
    then B releases ``held`` and I ``freed by I``; W releases the rest as usual."""
    code, stage, rc = program.comp_code, program.comp_stage, program.comp_recomputed
    assert rc is not None
    step = table[code, stage]
    gain = np.maximum(step, 0)
    held, freed, kept = (np.array([sz[i] for sz in sizes] or [0], dtype=np.int64) for i in range(3))
    f = rc & (code == _CODE_OF[ActionType.F])
    step[f] = kept[stage[f]]
    gain[f] = step[f]
    for kind in (ActionType.B, ActionType.I):
        sel = rc & (code == _CODE_OF[kind])
        st = stage[sel]
        gain[sel] = held[st] - kept[st]
        step[sel] = gain[sel] - (held[st] if kind is ActionType.B else freed[st])
    return step, gain


def _recompute_mid(program: Program, start: np.ndarray) -> np.ndarray:
    """Per action, when a recomputing single B or I has re-materialised its activation (its start plus the
    recomputed forward); NaN for every other action (a pair shows its high point at its forward half's end)."""
    schedule, costs = program.schedule, program.costs
    mid = np.full(program.num_actions, np.nan)
    rc = program.comp_recomputed
    assert rc is not None
    code = program.comp_code[program.single_comp]
    sel = rc[program.single_comp] & ((code == _CODE_OF[ActionType.B]) | (code == _CODE_OF[ActionType.I]))
    fwd = np.array([costs.op_cost(schedule, s, ActionType.F) * costs.compute_scale
                    for s in range(schedule.num_stages)] or [0.0])
    actions = program.single_idx[sel]
    mid[actions] = start[actions] + costs.dispatch_s + fwd[program.comp_stage[program.single_comp[sel]]]
    return mid


# -- helpers ----------------------------------------------------------------------------------------------------


_INT64_SAFE = 2**62
"""Byte totals are summed in int64 arrays; a schedule whose bytes could reach this is refused instead of wrapping."""


def _refuse_int64_bytes(
    program: Program, costs: StageCosts, held_of: list[tuple[int, int]], schedule: Schedule
) -> None:
    """Refuse activation and static sizes whose sums (every forward's bytes, plus every stage's static bytes) could
    pass int64: the per-value checks of the profile reader do not bound the totals of a whole step."""
    forwards = np.bincount(program.comp_stage[program.comp_code == _CODE_OF[ActionType.F]],
                           minlength=max(schedule.num_stages, 1))
    total = sum(int(forwards[s]) * int(held) for s, (held, _) in enumerate(held_of))
    total += sum(costs.static_bytes_of(schedule, s) for s in range(schedule.num_stages))
    if 2 * total >= _INT64_SAFE:
        raise CostError(
            f"costs {costs.source!r}: the step holds up to {total:.3e} bytes of activations and parameters, beyond "
            f"the {_INT64_SAFE:.2e} bytes ppsim can add up exactly; check the profile's byte sizes"
        )


def _within_limit(times: np.ndarray) -> np.ndarray:
    """Each op or hand-off time is finite and at most ``MAX_COST``: the rule ``--costs`` applies, for costs from any
    source (a profile's tiny bandwidth or huge op times too), so that every total and export stays representable."""
    return np.isfinite(times) & (np.abs(times) <= MAX_COST)


def _refuse_non_finite(costs: StageCosts, what: str) -> None:
    raise CostError(
        f"costs {costs.source!r}: {what}, beyond the limit of {MAX_COST:g} per op; costs must keep the step finite, "
        "use smaller units (e.g. ms instead of s) or fix the profile"
    )


def _rank_of(offsets: np.ndarray, a: int) -> int:
    return int(np.searchsorted(offsets, a, side="right")) - 1


def _where(schedule: Schedule, offsets: np.ndarray, a: int) -> str:
    r = _rank_of(offsets, a)
    return f"rank {r} position {a - int(offsets[r])}"


def _action_at(schedule: Schedule, offsets: np.ndarray, a: int) -> Action:
    r = _rank_of(offsets, a)
    return schedule.actions[r][a - int(offsets[r])]


def _distinct(values: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """``numpy.unique(values, return_inverse=True)`` for values in ``[0, bound)``; a table, not a sort, when the
    bound is small."""
    if bound > 4 * len(values) + 4096:
        return np.unique(values, return_inverse=True)
    seen = np.zeros(bound, dtype=bool)
    seen[values] = True
    uniq = np.flatnonzero(seen)
    index = np.zeros(bound, dtype=np.int64)
    index[uniq] = np.arange(len(uniq))
    return uniq, index[values]


def _view(values: np.ndarray) -> memoryview[Any]:
    """``values`` in place, read and written item by item as Python numbers (ints or floats, as its dtype)."""
    return memoryview(cast("ReadableBuffer", values))  # numpy types ndarray's buffer protocol on Python >= 3.12 only


def _ints(values: Sequence[int | None]) -> np.ndarray:
    """An int64 array from a list of ints (a list comprehension plus this beats a generator into ``fromiter``); a
    ``None`` among them raises ``TypeError`` (:func:`_microbatches` reports the action)."""
    return np.fromiter(values, dtype=np.int64, count=len(values))


def _kind_codes(types: list[ActionType]) -> np.ndarray:
    """Kind codes of action types; a list of one kind only (every forward half) is counted, not mapped."""
    if types and types.count(types[0]) == len(types):
        return np.full(len(types), _CODE_OF[types[0]], dtype=np.int8)
    return np.frombuffer(bytearray([_CODE_OF[t] for t in types]), dtype=np.int8)
