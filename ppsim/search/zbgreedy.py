"""The zero-bubble authors' greedy auto-scheduler for one stage per rank, rebuilt as a seed of the search.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Section 3.1, build their automatic schedule in two
steps: a greedy order, then (optionally) an ILP that only retimes it. The greedy is what their public scheduler
returns without the ILP, and it is the order the search must not lose to (docs/search.md, "Production sizes"). It
is rebuilt here from the algorithm, in the search's terms (a :class:`~ppsim.search.listsched.Problem`):

1. **Warm-up.** Every stage runs microbatch 0's forward. Walking back from the last stage, each stage adds as many
   further forwards as fit its memory cap and the time until microbatch 0's backward reaches it (``bubble_first``:
   a forward may end after the backward arrives, else it must start before); the counts are then made to decrease
   down the pipeline. The first backward chain runs from the last stage to the first.
2. **Steady rounds**, one per microbatch: each stage may run one forward (a stage never gets ahead of the next one;
   with ``prioritize_b`` a stage two forwards ahead of the next skips its forward when the next stage's forward
   and backward would come back before it), then the backward chain of the round, last stage first. Before each
   forward and backward the stage runs deferred W: as many as its memory needs, then those that end before the
   input arrives, then one more if the wait it fills is no worse than the largest idle time so far of any stage
   (``fill_wait``: always fill such a wait, else only when it is larger). Stage 0 flushes its W once its forwards
   are done.
3. The remaining W run at the end.

The rounds keep the authors' own timing (an action ends at its stage's previous end or its input's arrival plus
its cost), which decides the waits; the order is then judged by :func:`ppsim.simulator` like every other seed. The
8 variants (``bubble_first``, ``prioritize_b``, ``fill_wait``) are all returned; a variant that runs out of memory
(a forward or backward with no W left to free it) is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product

from ppsim.ir import Action, ActionType
from ppsim.search.listsched import Problem

_F, _I, _W = ActionType.F, ActionType.I, ActionType.W


class _OutOfMemory(Exception):
    """A forward or backward needs memory and no deferred W is left to free it."""


@dataclass
class _Greedy:
    """The state of one greedy run: per stage its counts, end time, memory, idle time and order."""

    p: Problem
    prioritize_b: bool
    fill_wait: bool
    done: dict[ActionType, list[int]] = field(init=False)
    ends: dict[ActionType, list[list[float]]] = field(init=False)
    free_at: list[float] = field(init=False)
    held: list[float] = field(init=False)
    idle: list[float] = field(init=False)
    orders: list[list[Action]] = field(init=False)

    def __post_init__(self) -> None:
        S, M = self.p.template.num_stages, self.p.num_microbatches
        self.done = {k: [0] * S for k in (_F, _I, _W)}
        self.ends = {k: [[0.0] * M for _ in range(S)] for k in (_F, _I, _W)}
        self.free_at = [0.0] * S
        self.held = [0.0] * S
        self.idle = [0.0] * S
        self.orders = [[] for _ in range(S)]

    # --- what one action costs, holds and waits for ------------------------------------------------------------
    def cost(self, kind: ActionType, s: int) -> float:
        return {_F: self.p.f, _I: self.p.i, _W: self.p.w}[kind][s]

    def memory(self, kind: ActionType, s: int) -> float:
        if kind is _F:
            return self.p.act[s]
        if kind is _I:
            return -self.p.freed_by_i[s]
        return -(self.p.act[s] - self.p.freed_by_i[s])

    def arrival(self, kind: ActionType, s: int, mb: int) -> float | None:
        """When microbatch ``mb``'s input for this action reaches stage ``s`` (None: it has no remote input)."""
        S = self.p.template.num_stages
        if kind is _F and s > 0:
            return self.ends[_F][s - 1][mb] + self.p.fwd_delay[s - 1]
        if kind is _I and s < S - 1:
            return self.ends[_I][s + 1][mb] + self.p.bwd_delay[s]
        return None

    def put(self, kind: ActionType, s: int) -> None:
        mb = self.done[kind][s]
        cost = self.cost(kind, s)
        end = self.free_at[s] + cost
        ready = self.arrival(kind, s, mb) if kind is not _W else None
        if ready is not None and ready + cost > end:
            if self.done[_F][s] > 0:
                self.idle[s] += ready + cost - end
            end = ready + cost
        self.free_at[s] = end
        self.ends[kind][s][mb] = end
        self.held[s] += self.memory(kind, s)
        self.done[kind][s] += 1
        self.orders[s].append(Action(s, kind, mb))

    # --- W before a forward or backward ---------------------------------------------------------------------------
    def pending_w(self, s: int) -> bool:
        return self.done[_W][s] < self.done[_I][s]

    def make_room(self, kind: ActionType, s: int) -> None:
        while self.held[s] + self.memory(kind, s) > self.p.cap[s] + 1e-9:
            if not self.pending_w(s):
                raise _OutOfMemory
            self.put(_W, s)

    def fill(self, s: int, ready: float) -> None:
        """Run deferred W that end by ``ready``, then one more if the wait it fills is worth it."""
        while self.pending_w(s) and self.free_at[s] + self.cost(_W, s) <= ready:
            self.put(_W, s)
        if self.pending_w(s) and self.free_at[s] < ready:
            within = ready - self.free_at[s] <= max(self.idle) - self.idle[s]
            if self.fill_wait or not within:
                self.put(_W, s)

    # --- the phases -------------------------------------------------------------------------------------------
    def warm_up(self, bubble_first: bool) -> None:
        S, M = self.p.template.num_stages, self.p.num_microbatches
        for s in range(S):
            self.put(_F, s)
        extra = [0] * S
        back = self.ends[_F][S - 1][0] + self.p.i[S - 1]  # when microbatch 0's backward leaves the last stage
        for s in range(S - 2, -1, -1):
            held, t, comm = self.held[s], self.free_at[s], self.p.bwd_delay[s]
            while self.done[_F][s] + extra[s] < M and held + self.p.act[s] <= self.p.cap[s] + 1e-9:
                if (t + self.p.f[s] > back + comm) if bubble_first else (t >= back + comm):
                    break
                held += self.p.act[s]
                t += self.p.f[s]
                extra[s] += 1
            back = max(t, back + comm) + self.p.i[s]
        for s in range(1, S):
            while extra[s] > 0 and extra[s] >= extra[s - 1] and self.done[_F][s] + extra[s] < M:
                extra[s] -= 1
        for s in range(S):
            for _ in range(extra[s]):
                self.put(_F, s)
        for s in range(S - 1, -1, -1):
            self.put(_I, s)

    def wants_forward(self, s: int) -> bool:
        """Whether stage ``s`` runs a forward this round (before the pipeline-wide minimum is taken)."""
        S, M = self.p.template.num_stages, self.p.num_microbatches
        f = self.done[_F]
        if f[s] >= M:
            return False
        if not (self.prioritize_b and s + 1 < S and f[s] >= f[s + 1] + 2):
            return True
        back = self.free_at[s + 1] + self.p.f[s + 1] + self.p.i[s + 1] + self.p.bwd_delay[s]
        if self.free_at[s] >= back:
            return False
        held, w_cost, n = self.held[s] + self.p.act[s], 0.0, 0
        while held > self.p.cap[s] + 1e-9 and self.done[_W][s] + n < self.done[_I][s]:
            w_cost += self.p.w[s]
            held += self.memory(_W, s)
            n += 1
        if self.free_at[s] + self.p.f[s] + w_cost <= back:
            return True
        return back - self.free_at[s] > max(self.idle) - self.idle[s]

    def round(self, mb: int) -> None:
        S = self.p.template.num_stages
        want = [self.wants_forward(s) for s in range(S)]
        for s in range(S - 2, -1, -1):
            want[s] = want[s] and want[s + 1]
        for s in range(S):
            if want[s]:
                self.make_room(_F, s)
                if s > 0:
                    ready = self.arrival(_F, s, self.done[_F][s])
                    assert ready is not None  # s > 0: the input comes from stage s - 1
                    self.fill(s, ready)
                self.put(_F, s)
        for s in range(S - 1, -1, -1):
            self.make_room(_I, s)
            if s + 1 < S:
                ready = self.arrival(_I, s, mb)
                assert ready is not None  # s < S - 1: the gradient comes from stage s + 1
                self.fill(s, ready)
            if s == 0 and self.done[_F][s] == self.p.num_microbatches:
                while self.pending_w(s):
                    self.put(_W, s)
            self.put(_I, s)

    def run(self, bubble_first: bool) -> list[list[Action]]:
        self.warm_up(bubble_first)
        for mb in range(1, self.p.num_microbatches):
            self.round(mb)
        for s in range(self.p.template.num_stages):
            while self.pending_w(s):
                self.put(_W, s)
        return self.orders


def zb_greedy_orders(problem: Problem) -> Iterator[tuple[tuple[Action, ...], ...]]:
    """The greedy's per-rank orders, one per variant that completes (distinct ones only); nothing unless the
    placement has one stage per rank in a line (stage s on rank s)."""
    tpl = problem.template
    if tpl.num_stages != tpl.num_ranks or any(tpl.stage_to_rank[s] != s for s in range(tpl.num_stages)):
        return
    seen: set[tuple[tuple[Action, ...], ...]] = set()
    for bubble_first, prioritize_b, fill_wait in product((True, False), repeat=3):
        try:
            orders = _Greedy(problem, prioritize_b, fill_wait).run(bubble_first)
        except _OutOfMemory:
            continue
        key = tuple(tuple(row) for row in orders)
        if key not in seen:
            seen.add(key)
            yield key
