"""The zero-bubble authors' automatic V schedule (``v_auto_schedule``), rebuilt as a seed of the search.

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024), Section 3 and Appendix A: a schedule is
a building block repeated once per microbatch, squeezed and reordered. Their public scheduler tries every block of
the uniform-offset family under the cap and keeps the fastest. ppsim's own rendering of the framework
(:mod:`ppsim.schedules._vshape`, V-Min, V-Half and the search's block seeds) reorders differently; this module
follows the authors' steps instead, so that the order they return is one the search tries:

1. **Block.** Rank 0's period of 6 unit slots holds its first-chunk forward at 0 and the second-chunk forward, the
   second-chunk input backward and the first-chunk input backward anywhere else; from rank to rank the first-chunk
   forward and the second-chunk backward move ``d`` slots, the other two one slot back (``d0`` for the first ``n0``
   ranks, ``d1 <= d0`` after); each backward's W takes the first free slot after it in the period.
2. **Repeat** the block ``4R + M + 1`` times per rank and keep, for each kind, the ``M`` periods that follow the
   data: rank by rank down the V for the forward-flowing kinds, up it for the others, each kind's first copy being
   the first one after the previous rank's.
3. **Squeeze**: every computation moves to the earliest slot after its input's slot and its rank's previous
   computation, order kept.
4. **Warm-up**: each rank's computations before its first first-chunk backward are laid out again: first-chunk
   forwards spaced for the pipeline (``2(R-1-r)`` slots, then alternating with second-chunk forwards, ``min(r + 1,
   peak / 2)`` of those), then rounds of backward, W and forward. Squeeze again.
5. **Cool-down**: each rank's last backwards are placed tight after rank 0's last second-chunk forward
   (``(peak + 1) / 2`` of the first chunk, up to ``r + 1`` of the second) and its trailing W dropped, then put
   back in the free slots after the last W left; squeeze.
6. **Fill bubbles**: from left to right, each free slot takes the first later computation of the rank (one per
   kind, the first of each) whose input is already placed before it and that does not raise the rank's peak.
7. The W are relabelled in backward order.

Every order is judged by :func:`ppsim.simulator` (the authors pick by their own timing). Only ``M >= 2R`` is built
(the authors pad smaller ``M`` to ``2R`` and trim afterwards; ppsim's own blocks cover those sizes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from ppsim.ir import Action, ActionType

PERIOD = 6
KINDS = "FfBbWw"
"""F: first-chunk forward (flows down the ranks), f: second-chunk forward (up), B: second-chunk input backward
(down), b: first-chunk input backward (up), W and w: the weight backwards of B and b."""
_DOWN, _UP = "FB", "fb"
_W_OF = {"B": "W", "b": "w"}
_B_OF = {"W": "B", "w": "b"}
Grid = list[list[str]]
Block = list[list[int]]
"""Per rank, the slot in the period of each of the six kinds (``KINDS`` order)."""


class _Invalid(Exception):
    """A block whose steps do not yield a complete order (the authors' code asserts; the block is skipped)."""


# --- 1. the block family -------------------------------------------------------------------------------------------
def _with_w(pattern: list[int]) -> list[int]:
    used = {x for x in pattern if x >= 0}
    for backward, w in ((2, 4), (3, 5)):
        pos = next((pattern[backward] + j) % PERIOD for j in range(PERIOD)
                   if (pattern[backward] + j) % PERIOD not in used)
        pattern[w] = pos
        used.add(pos)
    return pattern


def _block(start: list[int], d0: int, d1: int, n0: int, num_ranks: int) -> Block | None:
    rows = [start]
    for r in range(num_ranks - 1):
        d = d0 if r < n0 else d1
        moved = [(rows[-1][k] + delta) % PERIOD for k, delta in enumerate((d, -1, d, -1))]
        if len(set(moved)) < 4:
            return None
        rows.append(_with_w(moved + [-1, -1]))
    return rows


def family(num_ranks: int) -> Iterator[tuple[int, int, int, int, int]]:
    """The block families in the authors' order: rank 0's second-chunk F, second-chunk I and first-chunk I slots,
    and ``d0 >= d1`` (:func:`blocks` gives each family's blocks)."""
    for f1 in range(1, PERIOD):
        for b1 in range(1, PERIOD):
            for b0 in range(1, PERIOD):
                if len({f1, b1, b0}) == 3:
                    for d0 in range(1, PERIOD):
                        for d1 in range(1, d0 + 1):
                            yield f1, b1, b0, d0, d1


def blocks(num_ranks: int, f1: int, b1: int, b0: int, d0: int, d1: int) -> Iterator[Block]:
    """One family's blocks for ``n0 = 1 .. R-1`` (more memory as ``n0`` grows; one block when ``d0 = d1``),
    built as they are asked for."""
    for n0 in range(1, num_ranks if d1 < d0 else min(num_ranks, 2)):
        block = _block(_with_w([0, f1, b1, b0, -1, -1]), d0, d1, n0, num_ranks)
        if block is not None:
            yield block


# --- 2. repeat -----------------------------------------------------------------------------------------------------
def _repeat(block: Block, m: int) -> Grid:
    p = len(block)
    grid = []
    for row in block:
        period = [" "] * PERIOD
        for k, slot in enumerate(row):
            period[slot] = KINDS[k]
        grid.append(period * (4 * p + m + 1))
    index = PERIOD
    for kind in "FfBb":
        for i in range(p) if kind in _DOWN else range(p - 1, -1, -1):
            for _ in range(PERIOD):
                if grid[i][index] == kind:
                    _keep_m(grid[i], index, m)
                    index += 1
                    if kind in _W_OF:
                        w = next((k for k in range(PERIOD) if grid[i][index + k] == _W_OF[kind]), None)
                        if w is not None:
                            _keep_m(grid[i], index + w, m)
                    break
                index += 1
    return grid


def _keep_m(row: list[str], first: int, m: int) -> None:
    """Clear the copies of the kind at ``first`` before it and from the ``m``-th period after it on."""
    for pos in range(first - PERIOD, -1, -PERIOD):
        row[pos] = " "
    for pos in range(first + PERIOD * m, len(row), PERIOD):
        row[pos] = " "


def peak(grid: Grid) -> int:
    """The largest activation count of any rank (a forward adds one, a W releases one)."""
    top = 0
    for row in grid:
        held = 0
        for c in row:
            held += 1 if c in "Ff" else -1 if c in "Ww" else 0
            top = max(top, held)
    return top


# --- 3. squeeze ----------------------------------------------------------------------------------------------------
def _squeeze(grid: Grid) -> Grid:
    p = len(grid)
    out = [[" "] * len(grid[0]) for _ in range(p)]
    count = [dict.fromkeys(KINDS, 0) for _ in range(p)]
    placed: dict[tuple[int, str, int], int] = {}
    nxt = [0] * p
    for j in range(len(grid[0])):
        for down in (True, False):
            for i in range(p) if down else range(p - 1, -1, -1):
                c = grid[i][j]
                if c == " " or (c in "FBW") != down:
                    continue
                n = count[i][c]
                at = nxt[i]
                if not (c in "Ww" or (i == 0 and c in _DOWN) or (i == p - 1 and c in _UP)):
                    src = (i - 1 if c in _DOWN else i + 1, c, n)
                    if src not in placed:
                        raise _Invalid
                    at = max(placed[src] + 1, at)
                out[i][at] = c
                count[i][c] = n + 1
                placed[(i, c, n)] = at
                nxt[i] = at + 1
    width = max(nxt)
    return [row[:width] for row in out]


# --- 4. warm-up ----------------------------------------------------------------------------------------------------
def _warm_up(grid: Grid, m: int) -> Grid:
    p = len(grid)
    top = min(peak(grid), 2 * p)
    for i, row in enumerate(grid):
        want_f1 = min(i + 1, top // 2, m)
        want_f0 = min(top - want_f1, m)
        n = dict.fromkeys("FfBW", 0)
        for j, c in enumerate(row):
            if c == "b":
                break
            if c in n:
                n[c] += 1
            row[j] = " "
        used = dict.fromkeys("FfBW", 0)
        j = i
        for _ in range(2 * (p - 1 - i)):
            _put(row, used, j, "F", min(want_f0, n["F"]))
            j += 1
        for _ in range(i + 1):
            _put(row, used, j, "F", min(want_f0, n["F"]))
            _put(row, used, j + 1, "f", min(want_f1, n["f"]))
            j += 2
        while any(used[c] < n[c] for c in n):
            _put(row, used, j, "B", n["B"])
            _put(row, used, j + 1, "W", n["W"])
            if used["f"] < n["f"]:
                _put(row, used, j + 2, "f", n["f"])
            else:
                _put(row, used, j + 2, "F", n["F"])
            j += 3
    return grid


def _put(row: list[str], used: dict[str, int], j: int, c: str, limit: int) -> None:
    """Lay ``c`` at slot ``j`` if fewer than ``limit`` are laid."""
    if used[c] < limit:
        row[j] = c
        used[c] += 1


# --- 5. cool-down --------------------------------------------------------------------------------------------------
def _cool_down(grid: Grid, m: int) -> Grid:
    p = len(grid)
    top = peak(grid)
    if top > 2 * p:
        raise _Invalid
    max_b0 = min((top + 1) // 2, m)
    max_b1 = min(top - max_b0, m)
    start = -1
    for i, row in enumerate(grid):
        n = dict.fromkeys("BbWw", 0)
        last_f1 = -1
        for j in range(len(row) - 1, -1, -1):
            c = row[j]
            if c == "f" and last_f1 == -1:
                last_f1 = j
            if (c == "B" and n["B"] < min(i + 1, max_b1)) or (c == "b" and n["b"] < max_b0):
                row[j] = " "
                n[c] += 1
        for j in range(len(row) - 1, -1, -1):
            if n["W"] >= n["B"] and n["w"] >= n["b"] and n["W"] + n["w"] >= top:
                break
            if row[j] in "Ww":
                n[row[j]] += 1
                row[j] = " "
        if i == 0:
            start = last_f1
        for k in range(n["b"]):
            at = start - i + 2 * p - 2 * k
            if not 0 <= at < len(row) or row[at] != " ":
                raise _Invalid
            row[at] = "b"
        for k in range(n["B"]):
            at = start + 1 + i - 2 * k
            if not 0 <= at < len(row):
                raise _Invalid
            row[at] = "B"
    _w_back(grid)
    return _squeeze(grid)


def _w_back(grid: Grid) -> None:
    """Owed W go to the free slots after the rank's last W (second chunk's first), the rest at the end."""
    for row in grid:
        last_w = max((j for j, c in enumerate(row) if c in "Ww"), default=-1)
        owed = {"W": 0, "w": 0}
        for j, c in enumerate(row):
            if c in _W_OF:
                owed[_W_OF[c]] += 1
            elif c in _B_OF:
                owed[c] -= 1
            elif c == " " and j > last_w:
                w = "W" if owed["W"] > 0 else "w" if owed["w"] > 0 else None
                if w is not None:
                    row[j] = w
                    owed[w] -= 1
        row.extend(["W"] * owed["W"] + ["w"] * owed["w"])
    width = max(len(row) for row in grid)
    for row in grid:
        row.extend([" "] * (width - len(row)))


# --- 6. fill bubbles -------------------------------------------------------------------------------------------------
def _fill(grid: Grid) -> None:
    p, width, top = len(grid), len(grid[0]), peak(grid)
    last = [{c: max((j for j, x in enumerate(row) if x == c), default=-1) for c in KINDS} for row in grid]
    held = [0] * p
    count = [dict.fromkeys(KINDS, 0) for _ in range(p)]
    placed: dict[tuple[int, str, int], int] = {}

    def record(i: int, j: int, c: str) -> None:
        placed[(i, c, count[i][c])] = j
        count[i][c] += 1
        held[i] += 1 if c in "Ff" else -1 if c in "Ww" else 0

    for j in range(width):
        for i, row in enumerate(grid):
            if row[j] != " ":
                record(i, j, row[j])
                continue
            k = _movable(grid, i, j, last[i], held[i], top, count[i], placed)
            if k is not None:
                row[j], row[k] = row[k], " "
                record(i, j, row[j])


def _movable(grid: Grid, i: int, j: int, last: dict[str, int], held: int, top: int, count: dict[str, int],
             placed: dict[tuple[int, str, int], int]) -> int | None:
    """The slot of the first later computation of rank ``i`` that may move to free slot ``j`` (each kind's first
    occurrence only), or None."""
    p, row = len(grid), grid[i]
    available = {c for c in KINDS if last[c] > j}
    delta = rise = 0
    for k in range(j + 1, len(row)):
        if not available:
            return None
        c = row[k]
        delta += 1 if c in "Ff" else -1 if c in "Ww" else 0
        before, rise = rise, max(rise, delta)
        if c not in available:
            continue
        available.discard(c)
        if c in "Ff" and held + before >= top:
            continue
        n = count[c]
        if c in "Ww":
            ok = count[_B_OF[c]] > n
        elif (c in _DOWN and i > 0) or (c in _UP and i + 1 < p):
            src = placed.get((i - 1 if c in _DOWN else i + 1, c, n), -1)
            ok = 0 <= src < j
        elif c == "B":  # rank 0: the turn of the V
            ok = count["f"] > n
        elif c in _UP:  # last rank: after its own forward or backward of the first chunk
            ok = count["F" if c == "f" else "B"] > n
        else:
            ok = True
        if ok:
            return k
    return None


# --- 7. the order ----------------------------------------------------------------------------------------------------
def _orders(grid: Grid, m: int) -> tuple[tuple[Action, ...], ...]:
    p = len(grid)
    rows = []
    for i, row in enumerate(grid):
        first, second = i, 2 * p - 1 - i
        where = {"F": (first, ActionType.F), "f": (second, ActionType.F), "B": (second, ActionType.I),
                 "b": (first, ActionType.I), "W": (second, ActionType.W), "w": (first, ActionType.W)}
        queue: deque[str] = deque()
        count = dict.fromkeys(KINDS, 0)
        actions = []
        for c in row:
            if c == " ":
                continue
            if c in _W_OF:
                queue.append(_W_OF[c])
            elif c in _B_OF:  # relabelled: the j-th W releases the j-th backward
                if not queue:
                    raise _Invalid
                c = queue.popleft()
            stage, kind = where[c]
            actions.append(Action(stage, kind, count[c]))
            count[c] += 1
        if any(count[c] != m for c in KINDS):
            raise _Invalid
        rows.append(tuple(actions))
    return tuple(rows)


def first_peak(block: Block, num_microbatches: int) -> int:
    """The repeated block's peak before reordering (the reordered order holds no more)."""
    return peak(_repeat(block, num_microbatches))


def block_orders(block: Block, num_microbatches: int, cap: float) -> tuple[tuple[tuple[Action, ...], ...] | None, int]:
    """The authors' order for one block (``None`` if the block fails a step or exceeds ``cap``), and the peak that
    decides whether larger ``n0`` are worth trying (above the cap they are not)."""
    p, m = len(block), num_microbatches
    if m < 2 * p:
        return None, 0
    grid = _repeat(block, m)
    first_peak = peak(grid)
    if first_peak > min(cap, 2 * p):
        return None, first_peak
    try:
        grid = _warm_up(_squeeze(grid), m)
        grid = _squeeze(grid)
        if peak(grid) > first_peak:
            return None, first_peak
        grid = _cool_down(grid, m)
        _fill(grid)
        orders = _orders(grid, m)
    except (_Invalid, IndexError):
        return None, first_peak
    top = peak(grid)
    return (orders, top) if top <= first_peak else (None, first_peak)
