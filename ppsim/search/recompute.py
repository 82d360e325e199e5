"""``search --recompute auto``: which (stage, microbatch) activations to recompute so that an order fits the cap.

Two parts (docs/search.md, "Recompute under the cap"):

* :func:`choose_recompute` takes one order and makes it fit: a greedy over its memory peaks. While some rank's peak
  is above the cap, take the highest peak; the candidates are the activations held there that recomputing would
  shrink (their F done, their B or I still ahead, not yet recomputed), and those held between their I and a
  deferred W, which recomputing cannot shrink (the I re-materialises them for the W) but fusing their I and W into
  one B at the I's place releases; each is tried in the simulator and the one that costs the least makespan is
  kept. Once the order fits, every recomputation is tried out again (last first) and dropped when the order still
  fits without it. Every step is judged by :func:`ppsim.simulator`.
* :func:`search_recompute` chooses the orders to give it: the search's best order without a cap (the time lost is
  measured against it), the search's best under a few caps between that order's peak and the cap, every named
  schedule of the placement, and the search's best under the cap itself (which needs no recompute, when some order
  fits without). The fastest result that fits is then polished by a local search that treats recomputation as a
  move (:func:`polish`): move one action a few places in its rank's order, or give up one recomputation and let the
  greedy choose again; a move is kept when the simulator says the makespan drops and every rank still fits.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ppsim.costs import CostSpec, StageCosts, as_spec
from ppsim.errors import PPSimError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.recompute import RecomputeSet
from ppsim.result import SimResult
from ppsim.search.common import (
    SEARCH_NAME,
    MemoryCap,
    MemoryCapError,
    NamedResult,
    Placement,
    Progress,
    SearchResult,
    Solver,
    parse_memory_cap,
    peak_of,
)
from ppsim.search.driver import search

MAX_TRIED = 12
"""Candidates simulated per greedy step (the rest are ranked by how long they are held)."""

_F, _B, _I, _W = 0, 1, 2, 3  # Trace.comp_type codes
Move = tuple[str, tuple[int, int]]
"""``("recompute", (stage, microbatch))`` or ``("fuse", (stage, microbatch))``: its I and W become one B."""


@dataclass(frozen=True)
class Choice:
    """An order made to fit: the recomputed pairs and the re-simulated result."""

    schedule: Schedule
    recompute: RecomputeSet
    sim: SimResult


def choose_recompute(
    schedule: Schedule, costs: StageCosts, cap: MemoryCap | str, *, deadline: float | None = None,
    start: RecomputeSet | None = None,
) -> Choice | None:
    """The cheapest set of (stage, microbatch) recomputations found that makes ``schedule`` fit ``cap`` on every
    rank (``costs`` already for this schedule, from :meth:`ppsim.costs.CostSpec.for_schedule`), or ``None`` when even
    recomputing every activation held at a peak does not. Past ``deadline`` candidates are no longer simulated
    one by one: the one held longest is taken."""
    from ppsim.simulator import simulate

    cap = parse_memory_cap(cap)
    chosen = set(start or ())
    sim = simulate(schedule, costs, recompute=RecomputeSet(chosen))
    added: list[tuple[int, int]] = []

    def apply(move: Move) -> tuple[Schedule, set[tuple[int, int]]]:
        kind, pair = move
        if kind == "fuse":
            return fuse(schedule, pair), chosen
        return schedule, chosen | {pair}

    while True:
        worst = _worst_peak(sim, cap)
        if worst is None:
            break
        candidates = _held_at(sim, *worst, chosen)
        if not candidates:
            return None
        hurry = deadline is not None and time.perf_counter() > deadline
        tried = []
        for k, move in enumerate(candidates[: 1 if hurry else MAX_TRIED]):
            order, pairs = apply(move)
            try:
                trial = simulate(order, costs, recompute=RecomputeSet(pairs))
            except PPSimError:  # a fusion that deadlocks cannot happen (B where I was), but the judge decides
                continue
            tried.append((trial.makespan, _excess(trial, cap), k, move, order, pairs, trial))
        if not tried:
            return None
        _, _, _, move, schedule, chosen, sim = min(tried, key=lambda x: x[:3])
        if move[0] == "recompute":
            added.append(move[1])
    for pair in reversed(added):  # a later choice may have made an earlier one unnecessary
        trial = simulate(schedule, costs, recompute=RecomputeSet(chosen - {pair}))
        if _worst_peak(trial, cap) is None and trial.makespan <= sim.makespan + 1e-9:
            chosen.discard(pair)
            sim = trial
    return Choice(schedule, RecomputeSet(chosen), sim)


def _levels(sim: SimResult, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """Per action: the most its rank holds during it (``held before + what it adds first``), in the cap's unit."""
    t = sim.trace
    static: np.ndarray | float  # bytes: per action, its rank's static bytes; activations: none
    if unit == "bytes":
        assert t.byte_delta is not None and t.byte_plus is not None
        delta, plus, scale = t.byte_delta, t.byte_plus, 1
        static = np.repeat(np.asarray(t.static_bytes, dtype=np.float64), np.diff(t.offsets))
    else:
        delta, plus, scale = t.act_delta, t.act_plus, t.act_scale
        static = 0.0
    after = np.cumsum(delta)
    base = np.repeat(np.concatenate(([0], after))[t.offsets[:-1]], np.diff(t.offsets))
    high = (after - delta + plus - base) / scale + static
    return high, np.repeat(np.arange(len(t.offsets) - 1), np.diff(t.offsets))


def _worst_peak(sim: SimResult, cap: MemoryCap) -> tuple[int, int] | None:
    """``(rank, action)`` of the highest level above the cap, or ``None`` when every rank fits."""
    high, rank = _levels(sim, cap.unit)
    if not len(high) or float(high.max()) <= cap.amount + 1e-9:
        return None
    a = int(np.argmax(high))
    return int(rank[a]), a


def _excess(sim: SimResult, cap: MemoryCap) -> float:
    return max(0.0, peak_of(sim, cap.unit) - cap.amount)


def _held_at(sim: SimResult, rank: int, action: int, chosen: set[tuple[int, int]]) -> list[Move]:
    """The moves that lower ``rank``'s level at ``action``: recompute an activation whose F ends at or before it and
    whose B or I comes after it (not recomputed yet), or fuse one held between its I and a later W (both single
    actions) into a B. Held longest first (the most room to recompute in), fusions after."""
    t = sim.trace
    lo, hi = int(t.offsets[rank]), int(t.offsets[rank + 1])
    sel = np.flatnonzero((t.comp_owner >= lo) & (t.comp_owner < hi))
    at: dict[int, dict[tuple[int, int], int]] = {_F: {}, _B: {}, _I: {}, _W: {}}
    single = np.ones(len(t.comp_owner), dtype=bool)
    single[t.pair_first] = False
    single[t.pair_first + 1] = False
    for c in sel.tolist():
        code = int(t.comp_type[c])
        if code == _I and not single[c]:
            continue  # an I inside an overlapped pair: cannot be fused here (it still counts as a backward)
        at[code][(int(t.comp_stage[c]), int(t.comp_mb[c]))] = int(t.comp_owner[c])
    fwd, bwd = at[_F], {**at[_B], **at[_I]}
    for c in sel.tolist():  # paired I still end the F's reach
        if int(t.comp_type[c]) == _I:
            bwd.setdefault((int(t.comp_stage[c]), int(t.comp_mb[c])), int(t.comp_owner[c]))
    held = [(bwd[k] - fwd[k], k) for k in fwd if k in bwd and fwd[k] <= action < bwd[k] and k not in chosen]
    moves: list[Move] = [("recompute", k) for _, k in sorted(held, key=lambda x: (-x[0], x[1]))]
    inputs, weights = at[_I], at[_W]
    fusible = [(weights[k] - inputs[k], k) for k in inputs if k in weights and inputs[k] <= action < weights[k]]
    moves += [("fuse", k) for _, k in sorted(fusible, key=lambda x: (-x[0], x[1]))]
    return moves


def fuse(schedule: Schedule, pair: tuple[int, int]) -> Schedule:
    """``schedule`` with the I of ``pair`` (a single action) replaced by a B and its W dropped."""
    stage, mb = pair
    r = schedule.stage_to_rank[stage]
    row = []
    for a in schedule.actions[r]:
        if a.stage == stage and a.microbatch == mb and a.type is ActionType.I:
            row.append(Action(stage, ActionType.B, mb))
        elif not (a.stage == stage and a.microbatch == mb and a.type is ActionType.W):
            row.append(a)
    rows = list(schedule.actions)
    rows[r] = tuple(row)
    return schedule.with_actions(rows)


def polish(choice: Choice, costs: StageCosts, cap: MemoryCap, rng: random.Random, *, deadline: float,
           max_tries: int | None = None) -> Choice:
    """First-improvement local search with recomputation as a move (module docstring); the result fits ``cap``."""
    from ppsim.simulator import simulate

    current = choice
    tries = failures = 0
    while time.perf_counter() < deadline and failures < 2000 and (max_tries is None or tries < max_tries):
        tries += 1
        if current.recompute and rng.random() < 0.3:  # give one recomputation up, let the greedy choose again
            drop = rng.choice(sorted(current.recompute))
            cand = choose_recompute(current.schedule, costs, cap, start=RecomputeSet(current.recompute - {drop}),
                                    deadline=deadline)
            if cand is None or cand.recompute == current.recompute:
                failures += 1
                continue
        else:  # move one action a few places in its rank's order, the set kept
            rows = [list(r) for r in current.schedule.actions]
            r = rng.randrange(len(rows))
            j_step = rng.choice((-3, -2, -1, 1, 2, 3))
            if not rows[r]:
                failures += 1
                continue
            i = rng.randrange(len(rows[r]))
            if not 0 <= i + j_step < len(rows[r]):
                failures += 1
                continue
            rows[r].insert(i + j_step, rows[r].pop(i))
            order = current.schedule.with_actions(rows)
            try:
                sim = simulate(order, costs, recompute=current.recompute)
            except PPSimError:  # the move deadlocks
                failures += 1
                continue
            cand = Choice(order, current.recompute, sim)
        if cand.sim.makespan < current.sim.makespan - 1e-9 and peak_of(cand.sim, cap.unit) <= cap.amount + 1e-9:
            current, failures = cand, 0
        else:
            failures += 1
    return current


# --- the search ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecomputeResult:
    """``search --recompute auto``: the fastest order found that fits the cap with the recomputations it needs."""

    schedule: Schedule
    recompute: RecomputeSet
    sim: SimResult
    cap: MemoryCap
    uncapped: SearchResult
    """The search without a cap: the time lost is measured against its makespan."""
    source: str
    """Which order was made to fit: ``"searched, no cap"``, ``"searched under 6act"``, a named schedule's name."""
    tried: tuple[tuple[str, float, int], ...]
    """Every order tried: (source, makespan after recomputing, pairs recomputed); ``inf`` when it could not fit."""
    named: tuple[NamedResult, ...]
    elapsed_s: float

    @property
    def makespan(self) -> float:
        return self.sim.makespan

    @property
    def peak(self) -> float:
        return peak_of(self.sim, self.cap.unit)

    @property
    def time_lost(self) -> float:
        """Makespan above the uncapped best, as a fraction (0.05 = 5 % slower)."""
        base = self.uncapped.makespan
        return self.makespan / base - 1.0 if base > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "makespan": self.makespan, "bubble_ratio": self.sim.bubble_ratio, "peak": self.peak, "cap": str(self.cap),
            "cap_unit": self.cap.unit, "uncapped_makespan": self.uncapped.makespan, "time_lost": self.time_lost,
            "source": self.source, "recompute": self.recompute.sorted(),
            "num_recomputed": len(self.recompute),
            "tried": [{"source": s, "makespan": m if math.isfinite(m) else None, "num_recomputed": n}
                      for s, m, n in self.tried],
            "named": [n.__dict__ for n in self.named], "elapsed_s": self.elapsed_s,
            "csv": self.schedule.to_rows(),
        }


def search_recompute(
    num_ranks: int,
    num_microbatches: int,
    costs: CostSpec | StageCosts | None = None,
    memory_cap: MemoryCap | str | float = "1act",
    *,
    placement: Placement | str = Placement.loop,
    num_stages_per_rank: int | None = None,
    time_limit: float = 10.0,
    seed: int = 0,
    cost_scope: str | None = None,
    max_orders: int | None = None,
    solver: Solver | str = Solver.auto,
    progress: Callable[[Progress], None] | None = None,
) -> RecomputeResult:
    """The fastest order found that fits ``memory_cap`` on every rank when some of its activations are recomputed
    (the module docstring says how). The arguments are :func:`ppsim.search.search`'s; the time limit is shared:
    45 % for the search under the cap, 15 % for the uncapped search, 4 % for each of three relaxed caps and the rest
    (at least 10 % more) for choosing recomputations and polishing the two best results."""
    from ppsim.schedules import get_schedule

    t0 = time.perf_counter()
    costs = as_spec(costs)
    cap = parse_memory_cap(memory_cap)
    if cap.unit == "bytes" and not costs.has_memory:
        raise MemoryCapError(f"--memory-cap {memory_cap}: a cap in bytes needs activation sizes; pass --profile "
                             "P.json or give the cap as activations (e.g. 8act)")
    common = dict(placement=placement, num_stages_per_rank=num_stages_per_rank, seed=seed, cost_scope=cost_scope,
                  solver=solver, progress=progress)

    def share(frac: float) -> dict[str, object]:
        orders = None if max_orders is None else max(1, int(frac * max_orders))
        return dict(time_limit=frac * time_limit, max_orders=orders, **common)

    capped: SearchResult | None = None
    try:
        capped = search(num_ranks, num_microbatches, costs, cap, **share(0.45))  # type: ignore[arg-type]
    except MemoryCapError:
        pass  # no order fits without recomputing
    uncapped = search(num_ranks, num_microbatches, costs, None, **share(0.15))  # type: ignore[arg-type]
    scope = uncapped.cost_scope
    candidates: list[tuple[str, Schedule]] = [("searched, no cap", uncapped.schedule)]
    top = peak_of(uncapped.sim, cap.unit)
    # orders that need less recomputing than the uncapped one: two caps between, and (activations) the next whole one
    relaxed = {cap.amount + frac * (top - cap.amount) for frac in (2 / 3, 1 / 3)}
    if cap.unit == "act":
        relaxed.add(float(math.floor(cap.amount) + 1))
    for amount in sorted(relaxed, reverse=True):
        if not cap.amount + 1e-9 < amount < top - 1e-9:
            continue
        at = MemoryCap(round(amount, 3) if cap.unit == "act" else float(int(amount)), cap.unit)
        try:
            found = search(num_ranks, num_microbatches, costs, at, **share(0.04))  # type: ignore[arg-type]
        except MemoryCapError:
            continue
        candidates.append((f"searched under {at}", found.schedule))
    for named in uncapped.named:  # the placement's named schedules, as the search timed them
        try:
            candidates.append((named.name, get_schedule(named.name, num_ranks, num_microbatches,
                                                        named.num_stages_per_rank)))
        except PPSimError:
            continue
    deadline = t0 + time_limit
    tried: list[tuple[str, float, int]] = []
    fitted: list[tuple[float, str, Choice]] = []
    if capped is not None:
        source = f"searched under {cap} ({capped.source})"
        fitted.append((capped.makespan, source, Choice(capped.schedule, RecomputeSet(), capped.sim)))
        tried.append((source, capped.makespan, 0))
    for source, sched in candidates:
        tcosts = costs.for_schedule(sched, scope=scope)
        choice = choose_recompute(sched, tcosts, cap, deadline=deadline)
        if choice is None:
            tried.append((source, math.inf, 0))
            continue
        tried.append((source, choice.sim.makespan, len(choice.recompute)))
        fitted.append((choice.sim.makespan, source, choice))
    if not fitted:
        raise MemoryCapError(
            f"--memory-cap {cap}: no order fits even with recomputation (a backward re-materialises its whole "
            "activation, so a rank needs at least one activation plus the boundaries it keeps); raise the cap"
        )
    fitted.sort(key=lambda x: x[0])
    rng = random.Random(seed)
    polish_end = max(deadline, time.perf_counter() + 0.1 * time_limit)
    top_two = [f for k, f in enumerate(fitted) if k == 0 or f[0] > fitted[0][0] + 1e-9][:2]
    for k, (_, source, choice) in enumerate(top_two):  # the time left, shared
        end = time.perf_counter() + (polish_end - time.perf_counter()) / (len(top_two) - k)
        tcosts = costs.for_schedule(choice.schedule, scope=scope)
        polished = polish(choice, tcosts, cap, rng, deadline=end,
                          max_tries=None if max_orders is None else max(1, max_orders // 20))
        if polished.sim.makespan < choice.sim.makespan - 1e-9:
            tried.append((f"{source}, polished", polished.sim.makespan, len(polished.recompute)))
            fitted.append((polished.sim.makespan, f"{source}, polished", polished))
    _, source, choice = min(fitted, key=lambda x: x[0])
    sched = choice.schedule
    if source.startswith("searched") or source.endswith("polished") or choice.schedule.name != source:
        sched = replace(sched, name=SEARCH_NAME)
    from ppsim.simulator import simulate

    final = simulate(sched, costs.for_schedule(sched, scope=scope), recompute=choice.recompute)  # the judge, once more
    assert peak_of(final, cap.unit) <= cap.amount + 1e-9, "a chosen order must fit"
    return RecomputeResult(sched, choice.recompute, final, cap, uncapped, source, tuple(tried), uncapped.named,
                           time.perf_counter() - t0)
