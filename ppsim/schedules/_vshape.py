"""V-shape building blocks with controllable memory (Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS 2024): the stable pattern shared by V-Min and V-Half, and the paper's repeat-squeeze-reorder framework.

Every microbatch runs on each rank as one block of six unit slots: the forward of the first chunk (stage r), the
forward of the second chunk (stage 2R-1-r), the input backward of the second chunk, the input backward of the first
chunk, and the two weight backwards. Block k is block 0 shifted by 6k slots, so in the steady state every rank runs
one block per six slots with no idle slot when F = I = W. Where the four F/I slots of block 0 sit on rank r (its
*offsets*) decides how long each activation lives and so the peak memory: the lifespan of a block divided by the
period is the number of microbatches held at once. W fill the free slots.

Building a schedule from the offsets, as the paper's Section 3 and its authors' code do, in unit slots:

1. **Repeat**: block k's F/I slots are block 0's plus 6k.
2. **Reorder with W**: the W are put in the free slots (one queue, oldest first); then every computation of the
   warm-up (before rank 0's first first-chunk I) and of the cool-down (after rank 0's last first-chunk F), taken in
   slot order, moves to the earliest free slot after its inputs' slots where the rank's peak memory does not grow.
3. **Reorder without W**: the W are dropped and the cool-down reordered again, memory counted as if each I's W ran
   at the next free slot.
4. **W per chunk**: the W are put in the free slots again, second chunk's first, each chunk's oldest first.

The order of each rank is its slots sorted by time; the simulator then runs every action as early as its inputs
allow, which squeezes out the idle slots left. Memory counts as ppsim's ``peak_activations`` does: an F adds one
chunk activation, its W releases it (an I releases none). With ``reorder=False`` only steps 1 and a single-queue W
fill run (the plain stable pattern).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ppsim.ir import Action, Schedule
from ppsim.schedules._phases import F, I, W, make_schedule, require_sizes, v_placement

PERIOD = 6
KINDS = 4
"""Slot kinds of a block, in order: first-chunk F, second-chunk F, second-chunk I, first-chunk I."""
_F0, _F1, _I1, _I0 = range(KINDS)
_HOLDS = (1, 1, 0, 0)
"""What each kind adds to the rank's activations (a W releases one)."""


def pattern_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    offsets: Sequence[tuple[int, int, int, int]],
    *,
    reorder: bool = True,
) -> Schedule:
    """Lay out ``offsets[r] = (first-chunk F, second-chunk F, second-chunk I, first-chunk I)`` slot of block 0
    and build the order (see the module docstring)."""
    R, m = num_ranks, num_microbatches
    for r in range(R):
        assert len({x % PERIOD for x in offsets[r]}) == 4, f"{name}: slots of rank {r} collide"
    # Step 1: repeat
    slots = [[[x + PERIOD * k for k in range(m)] for x in offsets[r]] for r in range(R)]
    if not reorder:
        rows = [_order(r, R, slots[r], _place_w(slots[r], per_chunk=False)) for r in range(R)]
        return make_schedule(name, rows, v_placement(R), m, 2)
    # Step 2: reorder warm-up and cool-down with the W in place
    with_w = [_Rank(kinds, _place_w(kinds, per_chunk=False)[0]) for kinds in slots]
    _reorder(with_w, warm_up=True)
    # Step 3: drop the W, reorder the cool-down again
    without_w = [_Rank(rank.kinds, None) for rank in with_w]
    _reorder(without_w, warm_up=False)
    # Step 4: W per chunk
    rows = [_order(r, R, rank.kinds, _place_w(rank.kinds, per_chunk=True)) for r, rank in enumerate(without_w)]
    return make_schedule(name, rows, v_placement(R), m, 2)


def build_pattern(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    num_stages_per_rank: int,
    offsets: Sequence[tuple[int, int, int, int]],
) -> Schedule:
    require_sizes(name, num_ranks, num_microbatches, num_stages_per_rank, fixed_stages_per_rank=2)
    return pattern_schedule(name, num_ranks, num_microbatches, offsets)


@dataclass
class _Rank:
    """One rank's slots: ``kinds[k][mb]`` for the four F/I kinds; ``ws`` the W slots in order (one queue: the j-th
    W releases the j-th I's activation), or ``None`` when each I's W is taken to run at the next free slot."""

    kinds: list[list[int]]
    ws: list[int] | None
    walk: _Walk | None = None
    """Without W in place: the rank's events and the state after each, kept up to date by the moves."""


def _place_w(kinds: list[list[int]], *, per_chunk: bool) -> list[list[int]]:
    """W slots: each free slot runs a pending W (with ``per_chunk``, the second chunk's first), the rest at the end.

    Returns one queue, or two (second chunk, first chunk) with ``per_chunk``; within a queue oldest first. Walks
    the occupied slots in order and only as many free slots as there are W pending."""
    events = sorted((t, k) for k in range(KINDS) for t in kinds[k])
    queues: list[list[int]] = [[], []] if per_chunk else [[]]
    pending = [0] * len(queues)
    last = -1
    for t, k in events:
        for free in range(last + 1, t):
            q = next((q for q in range(len(queues)) if pending[q]), None)
            if q is None:
                break
            queues[q].append(free)
            pending[q] -= 1
        if k in (_I1, _I0):
            pending[k - _I1 if per_chunk else 0] += 1
        last = t
    for q in range(len(queues)):
        for _ in range(pending[q]):
            last += 1
            queues[q].append(last)
    return queues


def _peak(rank: _Rank) -> int:
    """The rank's peak activations over its slots (see :class:`_Rank` for where the W are taken to run).

    Walks the occupied slots in time order only (a rank's slots span about 6R, its computations 6M)."""
    events = [(t, _HOLDS[k], k >= _I1) for k in range(KINDS) for t in rank.kinds[k]]
    if rank.ws is not None:
        events += [(t, -1, False) for t in rank.ws]
    events.sort()
    held = peak = owed = 0
    last = -1
    for t, change, owes in events:
        if rank.ws is None and owed:  # each I's W runs at the next free slot
            released = min(owed, t - last - 1)
            held -= released
            owed -= released
        held += change
        owed += owes
        peak = max(peak, held)
        last = t
    return peak


def _reorder(ranks: list[_Rank], *, warm_up: bool) -> None:
    """Move computations of the warm-up (if ``warm_up``) and the cool-down to the earliest free slot after their
    inputs where the rank's peak stays within the schedule's, taking them in slot order (ties: rank, kind, mb)."""
    R = len(ranks)
    m = len(ranks[0].kinds[0])
    limit = max(_peak(rank) for rank in ranks)
    items = [(t, r, k, mb) for r, rank in enumerate(ranks) for k in range(KINDS) for mb, t in enumerate(rank.kinds[k])]
    if ranks[0].ws is not None:
        for r, rank in enumerate(ranks):
            assert rank.ws is not None  # the ranks are built all with W slots or all without
            items += [(t, r, KINDS, j) for j, t in enumerate(rank.ws)]
    used: list[set[int]] = [set() for _ in range(R)]
    phase = "warm-up"
    for t, r, k, mb in sorted(items):
        if phase == "warm-up" and k == _I0 and r == 0:
            phase = "steady"
        if phase == "steady":
            if k == _F0 and mb == m - 1:
                phase = "cool-down"
            used[r].add(t)
            continue
        if phase == "warm-up" and not warm_up:
            used[r].add(t)
            continue
        used[r].add(_move(ranks, r, k, mb, t, used[r], limit))


def _move(ranks: list[_Rank], r: int, k: int, mb: int, t: int, used: set[int], limit: int) -> int:
    """The earliest free slot before ``t`` after the inputs of ``(r, k, mb)`` that keeps the peak within ``limit``
    (``t`` if none); the slot is set in ``ranks``."""
    rank = ranks[r]
    slots = rank.ws if k == KINDS else rank.kinds[k]
    assert slots is not None
    ready = slots[mb - 1] if mb > 0 else -1
    if k == KINDS:  # the j-th W follows the j-th backward of the rank
        ready = max(ready, sorted(rank.kinds[_I1] + rank.kinds[_I0])[mb])
    else:
        if k > _F0:
            ready = max(ready, rank.kinds[k - 1][mb])
        upstream = r - 1 if k in (_F0, _I1) else r + 1  # first-chunk F and second-chunk I come from rank r-1
        if 0 <= upstream < len(ranks):
            ready = max(ready, ranks[upstream].kinds[k][mb])
    if rank.ws is not None:
        # With the W in place only an earlier F can raise the peak (an earlier W releases sooner, an I holds
        # nothing), and only on the slots it moves across: it adds one to what the rank holds there.
        first = _room_from(rank, ready + 1, t, limit) if k in (_F0, _F1) else ready + 1
        for slot in range(first, t):
            if slot not in used:
                slots[mb] = slot
                return slot
        return t
    # Each I's W runs at the next free slot: only the events from the new slot on see a change
    if rank.walk is None:
        rank.walk = _Walk(rank)
    event = (t, _HOLDS[k], k >= _I1)
    for slot in range(ready + 1, t):
        if slot not in used and rank.walk.peak_if_moved(event, slot) <= limit:
            slots[mb] = slot
            rank.walk.move(event, slot)
            return slot
    return t


class _Walk:
    """A rank's events in time order, ``(slot, change in activations, whether it owes a W)``, with the state
    ``(held, owed, peak)`` after each; each I's W runs at the next free slot (the rank's W not in place)."""

    def __init__(self, rank: _Rank) -> None:
        self.events = sorted((t, _HOLDS[k], k >= _I1) for k in range(KINDS) for t in rank.kinds[k])
        self.states: list[tuple[int, int, int]] = []
        self._redo(0)

    def _state_before(self, i: int) -> tuple[int, int, int, int]:
        if i == 0:
            return 0, 0, 0, -1
        held, owed, peak = self.states[i - 1]
        return held, owed, peak, self.events[i - 1][0]

    @staticmethod
    def _step(state: tuple[int, int, int, int], event: tuple[int, int, bool]) -> tuple[int, int, int, int]:
        held, owed, peak, last = state
        t, change, owes = event
        released = min(owed, t - last - 1)
        held += change - released
        owed += owes - released
        return held, owed, max(peak, held), t

    def _redo(self, i: int) -> None:
        del self.states[i:]
        state = self._state_before(i)
        for event in self.events[i:]:
            state = self._step(state, event)
            self.states.append(state[:3])

    def peak_if_moved(self, event: tuple[int, int, bool], slot: int) -> int:
        """The rank's peak with ``event`` moved to ``slot`` (earlier): the state before ``slot`` is unchanged."""
        i = bisect_left(self.events, (slot,))
        state = self._state_before(i)
        moved = (slot, event[1], event[2])
        state = self._step(state, moved)
        for other in self.events[i:]:
            if other != event:
                state = self._step(state, other)
        return state[2]

    def move(self, event: tuple[int, int, bool], slot: int) -> None:
        self.events.remove(event)
        i = bisect_left(self.events, (slot,))
        self.events.insert(i, (slot, event[1], event[2]))
        self._redo(i)


def _room_from(rank: _Rank, first: int, end: int, limit: int) -> int:
    """The earliest slot x >= ``first`` such that one more activation held over [x, end) stays within ``limit``
    (what the rank holds changes only at its F and W slots, so only those in the window are visited)."""
    ws = rank.ws
    assert ws is not None
    plus = (rank.kinds[_F0], rank.kinds[_F1])

    def held_at(x: int) -> int:
        return sum(bisect_right(f, x) for f in plus) - bisect_right(ws, x)

    events = sorted({t for f in (*plus, ws) for t in f[bisect_left(f, first):bisect_left(f, end)]})
    starts = [first, *[t for t in events if t > first]]
    most = -1
    for k in range(len(starts) - 1, -1, -1):  # segments from the right: [starts[k], next start)
        most = max(most, held_at(starts[k]))
        if most + 1 > limit:
            return starts[k + 1] if k + 1 < len(starts) else end
    return first


def _order(r: int, num_ranks: int, kinds: list[list[int]], ws: list[list[int]]) -> list[Action]:
    """Rank r's actions sorted by slot; W queues: one (the j-th W for the j-th I) or two (second chunk, first)."""
    first, second = r, 2 * num_ranks - 1 - r
    stage_of = (first, second, second, first)
    timed = [(t, Action(stage_of[k], F if k in (_F0, _F1) else I, mb)) for k in range(KINDS)
             for mb, t in enumerate(kinds[k])]
    if len(ws) == 2:
        timed += [(t, Action(stage, W, mb)) for stage, queue in zip((second, first), ws) for mb, t in enumerate(queue)]
    else:
        backwards: deque[Action] = deque(a for _, a in sorted(timed) if a.type is I)
        timed += [(t, Action(b.stage, W, b.microbatch)) for t, b in zip(ws[0], backwards)]
    return [a for _, a in sorted(timed, key=lambda x: x[0])]




# --- the building-block family (the paper's Appendix A), for the search's seeds ------------------------------------
Offsets = tuple[tuple[int, int, int, int], ...]


@lru_cache(maxsize=64)
def building_blocks(num_ranks: int) -> tuple[Offsets, ...]:
    """Every building block of the paper's uniform-offset family, as block-0 slots per rank (deduplicated).

    Rank 0's four F/I kinds sit anywhere in the period (its first-chunk F at 0). From each rank to the next, the
    first-chunk F and the second-chunk I move ``d`` slots later and the second-chunk F and the first-chunk I one
    slot earlier, modulo the period; ``d = d0`` for the first ``n0`` ranks and ``d1 <= d0`` after (V-Min is
    ``d = 1``, V-Half ``d = 2``; larger ``d`` hold more memory). A block whose kinds collide on a rank is dropped.
    The positions in the period become slots by the order the data flows: each rank's slot of a kind is the first
    one after the slot it depends on (the previous rank's, or the turn of the V)."""
    R = num_ranks
    seen: dict[Offsets, None] = {}
    for second_f in range(1, PERIOD):
        for second_i in range(1, PERIOD):
            for first_i in range(1, PERIOD):
                if len({second_f, second_i, first_i}) < 3:
                    continue
                for d0 in range(1, PERIOD):
                    for d1 in range(1, d0 + 1):
                        for n0 in range(1, max(R, 2)):
                            pos = _positions((0, second_f, second_i, first_i), R, d0, d1, n0)
                            if pos is not None:
                                seen.setdefault(_absolute(pos), None)
    return tuple(seen)


def _positions(
    start: tuple[int, int, int, int], num_ranks: int, d0: int, d1: int, n0: int
) -> list[tuple[int, int, int, int]] | None:
    pos = [start]
    for r in range(1, num_ranks):
        d = d0 if r <= n0 else d1
        f0, f1, i1, i0 = pos[-1]
        nxt = ((f0 + d) % PERIOD, (f1 - 1) % PERIOD, (i1 + d) % PERIOD, (i0 - 1) % PERIOD)
        if len(set(nxt)) < 4:
            return None
        pos.append(nxt)
    return pos


def _absolute(pos: list[tuple[int, int, int, int]]) -> Offsets:
    R = len(pos)

    def after(slot: int, position: int) -> int:  # the first slot after ``slot`` at ``position`` in the period
        return slot + 1 + (position - slot - 1) % PERIOD

    f0, f1, i1, i0 = [0] * R, [0] * R, [0] * R, [0] * R
    f0[0] = pos[0][_F0]
    for r in range(1, R):
        f0[r] = after(f0[r - 1], pos[r][_F0])
    f1[R - 1] = after(f0[R - 1], pos[R - 1][_F1])
    for r in range(R - 2, -1, -1):
        f1[r] = after(f1[r + 1], pos[r][_F1])
    i1[0] = after(f1[0], pos[0][_I1])
    for r in range(1, R):
        i1[r] = after(i1[r - 1], pos[r][_I1])
    i0[R - 1] = after(i1[R - 1], pos[R - 1][_I0])
    for r in range(R - 2, -1, -1):
        i0[r] = after(i0[r + 1], pos[r][_I0])
    return tuple((f0[r], f1[r], i1[r], i0[r]) for r in range(R))


def plain_peak(offsets: Offsets, num_microbatches: int) -> int:
    """The peak activations of the repeated block before reordering (the reordered schedule holds no more)."""
    peak = 0
    for block in offsets:
        kinds = [[x + PERIOD * k for k in range(num_microbatches)] for x in block]
        peak = max(peak, _peak(_Rank(kinds, _place_w(kinds, per_chunk=False)[0])))
    return peak


@lru_cache(maxsize=4096)
def block_schedule(num_ranks: int, num_microbatches: int, offsets: Offsets) -> Schedule:
    """The schedule one building block gives (repeated and reordered; cached: the search asks again per cap)."""
    return pattern_schedule("V building block", num_ranks, num_microbatches, offsets)
