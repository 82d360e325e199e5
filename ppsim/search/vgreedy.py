"""The greedy V construction at a memory level (the zero-bubble authors' ZB-V greedy, rebuilt): seeds for V placement.

Rank r holds stage r (first chunk) and 2R-1-r (second chunk). Two *directions* carry the work: ``DOWN`` runs towards
higher ranks (first-chunk forwards, second-chunk backwards) and ``UP`` towards lower ranks (second-chunk forwards,
first-chunk backwards). Every backward is split into I and W, W deferred. With per-direction costs F, I, W and a
hand-off delay c, the construction places computations rank by rank in rounds, keeping each rank's time:

1. **Warm-up**: one first-chunk forward on every rank, then from the last rank up, as many extra first-chunk
   forwards on ranks 0..r as fit in memory while rank r waits for its second-chunk forward, then that forward.
2. **Balance**: each rank runs at least as many forwards as the rank above it, alternating the directions.
3. **Steady rounds** (2M): every rank runs one backward (first-chunk ones where the input is there, lowest ranks
   last), then one forward; a pending W fills the wait for an input when it fits, and another W is run ahead when
   the wait would exceed the largest idle time of any rank (optionally for each direction); memory above the level
   is released by running W.
4. **Drain**: the W left.

The idle time each rank accumulated is fed back as an allowance and the construction re-run while the largest idle
time drops; eight variants (whether W are run ahead of forwards and of down-backwards, and whether an I releases
half of its activation) are tried, and every distinct order is returned: the simulator picks. Memory counts as
ppsim's ``peak_activations``: an F adds one chunk activation, its W releases it (a
variant counts half released by the I, as the authors' memory model does). The level is a target: the balancing
step does not check memory and may overshoot it by one, and below about 2R the construction rarely completes; the
caller simulates every order and keeps those that fit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import product

from ppsim.ir import Action, ActionType, Schedule
from ppsim.schedules._phases import make_schedule, v_placement

DOWN, UP = 0, 1
_F, _B, _W = 0, 1, 2  # kinds: forward, input backward, weight backward
_ACTION = {_F: ActionType.F, _B: ActionType.I, _W: ActionType.W}


class _Stuck(Exception):
    """A computation was due before its input was placed: the variant is dropped."""


@dataclass
class _Lane:
    free: float = 0.0
    held: int = 0
    idle: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * 6)  # (kind, direction) -> placed so far
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # (direction, mb) of I waiting for their W
    order: list[tuple[int, int, int]] = field(default_factory=list)  # (kind, direction, mb)

    def count(self, kind: int, direction: int) -> int:
        return self.counts[2 * kind + direction]


class _Build:
    """One run of the construction (see the module docstring)."""

    def __init__(self, num_ranks: int, num_microbatches: int, cost: tuple[float, float, float], comm: float,
                 level: int, *, fill_f: bool, fill_b: bool, allowance: list[float] | None,
                 i_frees_half: bool = False) -> None:
        self.R, self.M = num_ranks, num_microbatches
        self.cost, self.c = cost, comm
        # memory in half activations: an F holds two; its W releases them, or the I one and the W one
        self.level = 2 * level
        self.held_by = {_F: 2, _B: -1, _W: -1} if i_frees_half else {_F: 2, _B: 0, _W: -2}
        self.fill_f, self.fill_b = fill_f, fill_b
        self.allowance = allowance
        self.lanes = [_Lane() for _ in range(num_ranks)]
        self.end: dict[tuple[int, int, int, int], float] = {}  # (kind, direction, rank, mb) -> end time

    # --- placing one computation --------------------------------------------------------------------------------
    def _input(self, kind: int, direction: int, r: int, mb: int) -> float | None:
        """When the input of (kind, direction) on rank r for mb is there; None if it needs none from another rank."""
        if kind == _W:
            return None
        src = r - 1 if direction == DOWN else r + 1
        if 0 <= src < self.R:
            if (kind, direction, src, mb) not in self.end:
                raise _Stuck
            return self.end[(kind, direction, src, mb)] + self.c
        # the turns of the V, on the same rank: F up after F down (last rank), I down after F up (rank 0, the
        # loss), I up after I down (last rank)
        before = {(_F, UP): (_F, DOWN), (_B, DOWN): (_F, UP), (_B, UP): (_B, DOWN)}.get((kind, direction))
        if before is None:
            return None
        if (before[0], before[1], r, mb) not in self.end:
            raise _Stuck
        return self.end[(before[0], before[1], r, mb)]

    def put(self, kind: int, direction: int, r: int) -> None:
        lane = self.lanes[r]
        mb = lane.count(kind, direction)
        if mb >= self.M:
            raise _Stuck
        duration = self.cost[kind]
        ready = self._input(kind, direction, r, mb)
        start = lane.free if ready is None else max(lane.free, ready)
        if lane.count(_F, DOWN) > 0:
            lane.idle += start - lane.free
        self.end[(kind, direction, r, mb)] = lane.free = start + duration
        lane.held += self.held_by[kind]
        lane.counts[2 * kind + direction] += 1
        lane.order.append((kind, direction, mb))
        if kind == _B:
            lane.pending.append((direction, mb))

    def put_w(self, r: int) -> None:
        lane = self.lanes[r]
        if not lane.pending:
            raise _Stuck
        direction, _ = lane.pending.popleft()
        self.put(_W, direction, r)

    def most_idle(self, r: int) -> float:
        most = max(lane.idle for lane in self.lanes)
        if self.allowance is not None:
            most = max(most, max(self.allowance) - self.allowance[r])
        return most

    def wait_with_w(self, r: int, ready: float | None, run_ahead: bool) -> None:
        """Fill the wait for an input with pending W; run one more ahead when the wait exceeds the idle allowance."""
        lane = self.lanes[r]
        if ready is None:
            return
        while lane.pending and ready >= lane.free + self.cost[_W]:
            self.put_w(r)
        if lane.pending and ready - lane.free > self.most_idle(r) - lane.idle and run_ahead:
            self.put_w(r)

    # --- the phases ---------------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        R = self.R
        for r in range(R):
            self.put(_F, DOWN, r)
        for r in range(R - 1, -1, -1):
            if r < R - 1:
                arrival = self.end[(_F, UP, r + 1, 0)] + self.c
                lane = self.lanes[r]
                while (lane.held + 2 * (2 + 2 * r) <= self.level and lane.free + self.cost[_F] <= arrival
                       and lane.count(_F, DOWN) < self.M - r):
                    for j in range(r + 1):
                        self.put(_F, DOWN, j)
            self.put(_F, UP, r)

    def balance(self) -> None:
        direction = DOWN
        for r in range(1, self.R):
            lane, above = self.lanes[r], self.lanes[r - 1]
            for _ in range(4 * self.M + 4):
                fewer = lane.count(_F, DOWN) + lane.count(_F, UP) < above.count(_F, DOWN) + above.count(_F, UP)
                if not (fewer or lane.count(_F, UP) <= above.count(_F, UP) < self.M):
                    break
                for j in range(self.R - 1, r - 1, -1):
                    if self.lanes[j].count(_F, direction) < self.M:
                        self.put(_F, direction, j)
                direction = 1 - direction

    def backwards(self) -> None:
        R = self.R
        for r, lane in enumerate(self.lanes):
            while lane.held + self.held_by[_B] > self.level:
                self.put_w(r)
        down, up = [], []
        for r, lane in enumerate(self.lanes):
            if lane.count(_B, UP) >= lane.count(_B, DOWN):
                down.append(r)
            elif r == R - 1 or (_B, UP, r + 1, lane.count(_B, UP)) in self.end or lane.count(_B, DOWN) >= self.M:
                up.append(r)
            else:
                down.append(r)
        for r, direction in [(r, UP) for r in reversed(up)] + [(r, DOWN) for r in down]:
            lane = self.lanes[r]
            mb = lane.count(_B, direction)
            src = r - 1 if direction == DOWN else r + 1
            ready = self.end.get((_B, direction, src, mb)) if 0 <= src < R else None
            ready = None if ready is None else ready + self.c
            self.wait_with_w(r, ready, run_ahead=direction == UP or self.fill_b)
            self.put(_B, direction, r)

    def forwards(self) -> None:
        R = self.R
        for r, lane in enumerate(self.lanes):
            if lane.count(_F, UP) >= self.M:
                continue
            item = None
            if lane.count(_F, UP) >= lane.count(_F, DOWN):
                item = DOWN
            elif r == R - 1 or (_F, UP, r + 1, lane.count(_F, UP)) in self.end:
                item = UP
            elif lane.count(_F, DOWN) < self.M and (r == 0 or (_F, DOWN, r - 1, lane.count(_F, DOWN)) in self.end):
                item = DOWN
            if item is None:
                continue
            while lane.held + 2 > self.level:
                self.put_w(r)
            src = r - 1 if item == DOWN else r + 1
            ready = self.end.get((_F, item, src, lane.count(_F, item))) if 0 <= src < R else None
            ready = None if ready is None else ready + self.c
            self.wait_with_w(r, ready, run_ahead=self.fill_f)
            self.put(_F, item, r)

    def run(self) -> list[list[tuple[int, int, int]]] | None:
        try:
            self.warm_up()
            self.balance()
            for _ in range(2 * self.M):
                self.backwards()
                self.forwards()
            for r, lane in enumerate(self.lanes):
                while lane.pending:
                    self.put_w(r)
        except _Stuck:
            return None
        if any(lane.counts != [self.M] * 6 for lane in self.lanes):
            return None
        return [lane.order for lane in self.lanes]

    def most_idle_overall(self) -> float:
        return max(lane.idle for lane in self.lanes)


def greedy_v(num_ranks: int, num_microbatches: int, cost: tuple[float, float, float], comm: float,
             level: int, *, deadline: float | None = None) -> list[Schedule]:
    """The distinct greedy V orders built for ``level`` chunk activations per rank: every variant and every round
    of idle-time feedback (the caller simulates them and keeps the best that fits).

    ``cost``: per-chunk F, I and W; ``comm``: the hand-off delay between ranks; no new build starts after
    ``deadline`` (``time.perf_counter()``)."""
    found: dict[tuple[tuple[tuple[int, int, int], ...], ...], None] = {}
    for i_frees_half, fill_b, fill_f in product((False, True), (True, False), (True, False)):
        allowance: list[float] | None = None
        best_idle = float("inf")
        for _ in range(8):  # feed the idle times back while the largest drops
            if deadline is not None and time.perf_counter() >= deadline:
                break
            build = _Build(num_ranks, num_microbatches, cost, comm, level, fill_f=fill_f, fill_b=fill_b,
                           allowance=allowance, i_frees_half=i_frees_half)
            orders = build.run()
            if orders is None:
                break
            found.setdefault(tuple(tuple(o) for o in orders), None)
            idle = build.most_idle_overall()
            if idle >= best_idle - 1e-12:
                break
            best_idle = idle
            allowance = [lane.idle for lane in build.lanes]
    return [_schedule(num_ranks, num_microbatches, [list(o) for o in orders]) for orders in found]


def _schedule(R: int, M: int, orders: list[list[tuple[int, int, int]]]) -> Schedule:
    rows = []
    for r, order in enumerate(orders):
        first, second = r, 2 * R - 1 - r
        row = []
        for kind, direction, mb in order:
            # DOWN: first-chunk forward, second-chunk backward; UP: second-chunk forward, first-chunk backward
            stage = (first if direction == DOWN else second) if kind == _F else (second if direction == DOWN else first)
            row.append(Action(stage, _ACTION[kind], mb))
        rows.append(row)
    return make_schedule("greedy V", rows, v_placement(R), M, 2)
