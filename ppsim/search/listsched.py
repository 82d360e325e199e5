"""Memory-aware list scheduling: the engine behind ``ppsim.search`` (moved here from ``ppsim/schedules``, its only user).

Every rank is a single lane. Ranks are visited in order of the time they next decide (ties by a counter, so runs
are deterministic); at that time every computation that ends earlier is already placed, so a candidate's readiness
is known exactly. A rank picks among its ready candidates by a :class:`Rule`: the next forward of each of its stages
(microbatches in order), the next backward of each stage (B, or I with its W deferred), the oldest deferred W, and
for overlapped pairs a forward together with a backward. Timing follows :func:`ppsim.simulator`'s model exactly
(``start = max(rank free, inputs + hand-off delay)``), so the makespan computed here is the one the simulator reports.

Memory: a forward holds its stage's activation until the backward (B) or the W releases it (I releases the part the
cost model says). A microbatch entering a rank reserves the activations of all its stages there, so a rank never
admits work it could not finish: the scheduler cannot deadlock on memory.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from dataclasses import dataclass, field

from ppsim.costs import StageCosts
from ppsim.ir import Action, ActionType, Schedule, overlap

_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W
_INF = float("inf")


@dataclass(frozen=True)
class Problem:
    """What to schedule: placement, per-stage durations and hand-off delays, memory per stage and the cap.

    ``act`` / ``freed_by_i`` / ``cap`` share one unit: activation counts (``act`` = 1 per stage) or bytes.
    """

    template: Schedule
    f: tuple[float, ...]
    b: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    fwd_delay: tuple[float, ...]
    """Delay from stage s's F to the next stage's F (0 on one rank)."""
    bwd_delay: tuple[float, ...]
    """Delay from the next stage's backward to stage s's backward."""
    act: tuple[float, ...]
    freed_by_i: tuple[float, ...]
    cap: tuple[float, ...]
    """Per rank: the most activation memory (in ``act``'s unit) it may hold at once."""
    costs: StageCosts

    @property
    def num_ranks(self) -> int:
        return self.template.num_ranks

    @property
    def num_microbatches(self) -> int:
        return self.template.num_microbatches

    def need(self, rank: int) -> float:
        """Memory one microbatch holds on ``rank`` when all its forwards there are done."""
        return sum(self.act[s] for s in self.template.stages_of(rank))


def make_problem(template: Schedule, costs: StageCosts, cap: float | None, *, unit: str = "act") -> Problem:
    """A :class:`Problem` for ``template``'s placement. ``unit`` is ``"act"`` (counts) or ``"bytes"``."""
    S = template.num_stages
    chain = template.pipelines[0]
    nxt = {chain[k]: chain[k + 1] for k in range(len(chain) - 1)}
    fwd_delay = tuple(costs.comm_delay(template, s, nxt[s]) if s in nxt else 0.0 for s in range(S))
    bwd_delay = tuple(costs.comm_delay(template, nxt[s], s) if s in nxt else 0.0 for s in range(S))

    def op(kind: ActionType) -> tuple[float, ...]:
        return tuple(costs.op_cost(template, s, kind) for s in range(S))

    if unit == "bytes":
        pairs = [costs.activation_of(template, s) for s in range(S)]
        act = tuple(float(a) for a, _ in pairs)
        freed = tuple(float(f) for _, f in pairs)
        static = [sum(costs.static_bytes_of(template, s) for s in template.stages_of(r)) for r in range(template.num_ranks)]
        caps = tuple(_INF if cap is None else cap - st for st in static)
    else:
        act = tuple(1.0 for _ in range(S))
        freed = tuple(0.0 for _ in range(S))
        caps = tuple(_INF if cap is None else float(cap) for _ in range(template.num_ranks))
    return Problem(template, op(_F), op(_B), op(_I), op(_W), fwd_delay, bwd_delay, act, freed, caps, costs)


@dataclass(frozen=True)
class Rule:
    """How a rank chooses among ready candidates.

    - ``backward``: ``"split"`` (I now, W later), ``"fused"`` (B) or ``"auto"`` (B where cheaper than I + W).
    - ``backward_first``: a ready backward beats a ready forward (else forwards first while memory allows).
    - ``w_fill``: ``"eager"`` runs a deferred W whenever nothing else is ready; ``"fit"`` only when it ends before
      the next known candidate is ready (otherwise the rank waits).
    - ``w_keep``: deferred W a rank keeps before it runs one ahead of a ready forward (memory for later forwards).
    - ``inflight``: per rank, the most microbatches admitted and not yet released (``None``: memory decides).
    - ``pairs``: overlap a forward with a backward when the pair is cheaper than the two apart.
    - ``deep_first``: among ready forwards prefer the later chain position (finish microbatches before new ones).
    - ``reserve``: ``"all"``: a microbatch entering a rank reserves the memory of all its stages there (never
      stalls); ``"one"``: new microbatches leave room for one later-stage forward, which lets a rank hold more
      first-chunk activations (the V schedules' short-lived second chunk) at a small risk of stalling.
    - ``wait_b``: a rank idles up to this long for a backward about to arrive rather than start a forward or a W
      (the backward chain is the critical path).
    - ``jitter``: seed for random tie-breaking among equally ready candidates (``None``: none).
    """

    backward: str = "split"
    backward_first: bool = True
    w_fill: str = "eager"
    w_keep: int = 1 << 30
    inflight: tuple[int, ...] | None = None
    pairs: bool = False
    deep_first: bool = True
    wait_b: float = 0.0
    reserve: str = "all"
    jitter: int | None = None


@dataclass
class _Rank:
    order: list[Action] = field(default_factory=list)
    free: float = 0.0
    held: float = 0.0
    reserved: float = 0.0
    peak: float = 0.0
    pending_w: deque = field(default_factory=deque)


def list_schedule(
    problem: Problem, rule: Rule, *, deadline: float | None = None
) -> tuple[tuple[tuple[Action, ...], ...], float, tuple[float, ...]] | None:
    """Per-rank orders, their makespan and per-rank peak memory; ``None`` when the rule's limits stall the ranks,
    or when the clock (``time.perf_counter()``) passes ``deadline`` first."""
    lister = _Lister(problem, rule)
    if any(lister.need[r] > lister.cap[r] + 1e-9 for r in range(lister.num_ranks)):
        return None
    if not lister.run(deadline):
        return None
    ranks = lister.ranks
    makespan = max((st.free for st in ranks), default=0.0)
    return tuple(tuple(st.order) for st in ranks), makespan, tuple(st.peak for st in ranks)


class _Lister:
    """One list-scheduling run: the placement's tables, the ranks' state, and per decision its three phases
    (the candidates, :meth:`_choose`, then :meth:`_place` or :meth:`_next_time`)."""

    __slots__ = ("problem", "rule", "tpl", "num_ranks", "num_microbatches", "pos", "prev", "nxt", "rank_stages",
                 "entry", "f", "i_cost", "w", "b", "act", "freed", "need", "cap", "rng", "fwd_delay", "bwd_delay",
                 "reserve_all", "spare", "use_b", "end_f", "end_b", "next_f", "next_b", "released", "ranks", "left",
                 "heap", "pair_cost")

    def __init__(self, problem: Problem, rule: Rule) -> None:
        tpl = problem.template
        R, M, S = tpl.num_ranks, tpl.num_microbatches, tpl.num_stages
        chain = tpl.pipelines[0]
        self.problem, self.rule, self.tpl = problem, rule, tpl
        self.num_ranks, self.num_microbatches = R, M
        self.pos = {s: k for k, s in enumerate(chain)}
        self.prev = {chain[k + 1]: chain[k] for k in range(len(chain) - 1)}
        self.nxt = {chain[k]: chain[k + 1] for k in range(len(chain) - 1)}
        self.rank_stages = [sorted(tpl.stages_of(r), key=lambda s: self.pos[s]) for r in range(R)]
        self.entry = [st[0] for st in self.rank_stages]  # a microbatch enters a rank at its earliest chain stage
        self.f, self.i_cost, self.w, self.b = problem.f, problem.i, problem.w, problem.b
        self.act, self.freed = problem.act, problem.freed_by_i
        self.need = [problem.need(r) for r in range(R)]
        self.cap = problem.cap
        self.rng = random.Random(rule.jitter) if rule.jitter is not None else None
        self.fwd_delay, self.bwd_delay = problem.fwd_delay, problem.bwd_delay
        self.reserve_all = rule.reserve == "all"
        self.spare = [max((self.act[s] for s in self.rank_stages[r][1:]), default=0.0) for r in range(R)]
        b, i_cost, w = self.b, self.i_cost, self.w
        self.use_b = [
            rule.backward == "fused" or (rule.backward == "auto" and b[s] < i_cost[s] + w[s] - 1e-12)
            for s in range(S)
        ]
        self.end_f = [[_INF] * M for _ in range(S)]
        self.end_b = [[_INF] * M for _ in range(S)]
        self.next_f = [0] * S
        self.next_b = [0] * S
        self.released = [0] * S  # microbatches whose activation of stage s is fully freed (B, or W)
        self.ranks = [_Rank() for _ in range(R)]
        self.left = 2 * S * M  # forwards and backwards still to place (W are added as their I is placed)
        self.heap = [(0.0, r, r) for r in range(R)]
        self.pair_cost: dict[tuple[int, int, bool], float] = {}

    def run(self, deadline: float | None) -> bool:
        """Place every computation; ``False`` when the ranks stall or the clock passes ``deadline``. Each decision:
        the rank's candidates (inline, the hot part), """
        heap, ranks, rule = self.heap, self.ranks, self.rule
        act, cap, pos, need, spare, entry = self.act, self.cap, self.pos, self.need, self.spare, self.entry
        next_f, next_b, released, rank_stages = self.next_f, self.next_b, self.released, self.rank_stages
        f_ready, b_ready, choose, place = self.f_ready, self.b_ready, self._choose, self._place
        M, reserve_all, inflight, deep_first = self.num_microbatches, self.reserve_all, rule.inflight, rule.deep_first
        steps = stalls = 0
        counter = self.num_ranks
        while self.left:
            steps += 1
            if deadline is not None and steps % 1024 == 0 and time.perf_counter() >= deadline:
                return False
            t, _, r = heapq.heappop(heap)
            st = ranks[r]
            t = max(t, st.free)
            # candidates: the next forward (where memory allows) and the next backward of each of its stages
            fwd: list[tuple[float, int, int]] = []
            bwd: list[tuple[float, int, int]] = []
            for s in rank_stages[r]:
                mb = next_f[s]
                if mb < M:
                    if s == entry[r]:
                        room = need[r] if reserve_all else act[s] + spare[r]
                        ok = st.held + st.reserved + room <= cap[r] + 1e-9 and (
                            inflight is None or next_f[s] - released[s] < inflight[r]
                        )
                    else:
                        ok = reserve_all or st.held + act[s] <= cap[r] + 1e-9
                    if ok:
                        fwd.append((f_ready(s, mb), -pos[s] if deep_first else pos[s], s))
                mb = next_b[s]
                if mb < next_f[s]:
                    bwd.append((b_ready(s, mb), -pos[s], s))
            ready_f = [c for c in fwd if c[0] <= t]
            ready_b = [c for c in bwd if c[0] <= t]
            choice = choose(st, t, fwd, bwd, ready_f, ready_b)
            if choice is None:  # wait: decide again at the next time anything changes
                later, stuck = self._next_time(t, fwd, bwd)
                if later is None:
                    return False
                stalls = stalls + 1 if stuck else 0
                if stalls > 4 * self.num_ranks + 8:
                    return False
                counter += 1
                heapq.heappush(heap, (later, counter, r))
                continue
            stalls = 0
            end = place(r, st, choice, ready_b)
            st.free = end
            counter += 1
            heapq.heappush(heap, (end, counter, r))
        return True

    def f_ready(self, s: int, mb: int) -> float:
        p = self.prev.get(s)
        if p is None:
            return 0.0
        e = self.end_f[p][mb]
        return e + self.fwd_delay[p] if e < _INF else _INF

    def b_ready(self, s: int, mb: int) -> float:
        own = self.end_f[s][mb]
        if own == _INF:
            return _INF
        n = self.nxt.get(s)
        if n is None:
            return own
        e = self.end_b[n][mb]
        return max(own, e + self.bwd_delay[s]) if e < _INF else _INF

    def _choose(
        self, st: _Rank, t: float, fwd: list[tuple[float, int, int]], bwd: list[tuple[float, int, int]],
        ready_f: list[tuple[float, int, int]], ready_b: list[tuple[float, int, int]],
    ) -> tuple[str, int] | None:
        """What the rule runs now (``("f" | "b", stage)`` or ``("w", -1)``), or ``None`` to wait."""
        rule = self.rule
        soon = min((c[0] for c in bwd if t < c[0] < _INF), default=_INF)
        if not ready_b and soon - t <= rule.wait_b + 1e-12:
            return None  # wait for the backward
        if ready_b and (rule.backward_first or not ready_f):
            return ("b", _pick(ready_b, self.rng))
        if ready_f:
            if st.pending_w and len(st.pending_w) > rule.w_keep:
                return ("w", -1)
            return ("f", _pick(ready_f, self.rng))
        if st.pending_w:
            known = [c[0] for c in fwd + bwd if c[0] < _INF]
            s0 = st.pending_w[0][0]
            if rule.w_fill == "eager" or not known or t + self.w[s0] <= min(known) + 1e-9:
                return ("w", -1)
            if not fwd and all(c[0] == _INF for c in bwd):
                return ("w", -1)  # memory blocks every forward and no backward is known: W is the only progress
        return None

    def _next_time(
        self, t: float, fwd: list[tuple[float, int, int]], bwd: list[tuple[float, int, int]]
    ) -> tuple[float | None, bool]:
        """When a waiting rank decides again, and whether nothing it knows of changes before then (a stall);
        ``None`` when no rank has anything left to decide."""
        heap = self.heap
        known = [c[0] for c in fwd + bwd if t < c[0] < _INF]
        # the next time another rank decides: the heap's top when it is later than t, else a scan
        other = heap[0][0] if heap and heap[0][0] > t else min((e[0] for e in heap if e[0] > t), default=_INF)
        later = min(known + [other], default=_INF)
        if later < _INF:
            return later, False
        if not heap:
            return None, True
        return max(t, min(e[0] for e in heap)), True

    def _backward(self, st: _Rank, s: int, mb: int) -> Action:
        self.next_b[s] += 1
        if self.use_b[s]:
            st.held -= self.act[s]
            self.released[s] += 1
            return Action(s, _B, mb)
        st.held -= self.freed[s]
        st.pending_w.append((s, mb))
        return Action(s, _I, mb)

    def _place(self, r: int, st: _Rank, choice: tuple[str, int], ready_b: list[tuple[float, int, int]]) -> float:
        """Run ``choice`` on rank ``r`` (its state ``st``); returns its end."""
        kind, s = choice
        if kind == "f":
            end = self._place_forward(r, st, s, ready_b)
        elif kind == "b":
            mb = self.next_b[s]
            start = max(st.free, self.b_ready(s, mb))
            end = start + (self.b[s] if self.use_b[s] else self.i_cost[s])
            st.order.append(self._backward(st, s, mb))
            self.end_b[s][mb] = end
            self.left -= 1
        else:
            s, mb = st.pending_w.popleft()
            end = st.free + self.w[s]
            st.held -= self.act[s] - self.freed[s]
            self.released[s] += 1
            st.order.append(Action(s, _W, mb))
        if kind != "w" and st.order[-1].computations[-1].type is _I:
            self.left += 1
        elif kind == "w":
            self.left -= 1
        return end

    def _place_forward(self, r: int, st: _Rank, s: int, ready_b: list[tuple[float, int, int]]) -> float:
        """A forward of stage ``s``, overlapped with a ready backward when the rule pairs and the pair is cheaper."""
        rule, act, use_b, pair_cost = self.rule, self.act, self.use_b, self.pair_cost
        mb = self.next_f[s]
        start = max(st.free, self.f_ready(s, mb))
        pair_b = None
        if rule.pairs and ready_b:
            bs = _pick(ready_b, self.rng)
            key = (s, bs, use_b[bs])
            if key not in pair_cost:
                pair_cost[key] = self.problem.costs.pair_duration(self.tpl, s, bs, _B if use_b[bs] else _I)
            if pair_cost[key] < self.f[s] + (self.b[bs] if use_b[bs] else self.i_cost[bs]) - 1e-12:
                pair_b = bs
        if self.reserve_all:
            if s == self.entry[r]:
                st.reserved += self.need[r]
            st.reserved -= act[s]
        st.peak = max(st.peak, st.held + act[s])
        st.held += act[s]
        self.next_f[s] += 1
        self.left -= 1
        if pair_b is not None:
            bm = self.next_b[pair_b]
            start = max(start, self.b_ready(pair_b, bm))
            end = start + pair_cost[(s, pair_b, use_b[pair_b])]
            st.order.append(overlap(Action(s, _F, mb), self._backward(st, pair_b, bm)))
            self.left -= 1
            self.end_b[pair_b][bm] = end
        else:
            end = start + self.f[s]
            st.order.append(Action(s, _F, mb))
        self.end_f[s][mb] = end
        return end


def _pick(cands: list[tuple[float, int, int]], rng: random.Random | None) -> int:
    if rng is None or len(cands) == 1:
        return min(cands)[2]
    best = min(c[0] for c in cands)
    ties = sorted(c for c in cands if c[0] <= best + 1e-12)
    if len(ties) > 1 and rng.random() < 0.3:
        return rng.choice(ties)[2]
    return ties[0][2]
