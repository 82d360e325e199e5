"""The search driver: :func:`search` as a chain of named phases, each a short function.

Phase 0  set-up: check the inputs, build one problem per placement, time every named schedule, the lower bound.
Phase 1  seeds and list scheduling: for one stage per rank the zero-bubble authors' greedy; for V placement the
         controllable-memory building blocks that fit (up to 25 %
         of the budget, 15 % when CP-SAT follows), then the fixed rules, then random rules and mutations of the best
         ones (up to 60 % of the budget in all, 30 % when CP-SAT follows).
Phase 2  CP-SAT (with OR-Tools): polish the best order so far (60 % of the time left); where its model covers
         every order, prove the order optimal or raise the lower bound.
Phase 3  local search from the best few orders and the best named one, judged by the simulator.
Every phase stops early once the best order meets the lower bound (it is then optimal).
Phase 4  the result: never worse than the best named schedule that fits.

The state the phases share (the best order so far, the orders tried, the clock) is one :class:`_Run`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain

from ppsim.compare import resolve_scope
from ppsim.costs import CostSpec, StageCosts, as_spec
from ppsim.errors import PPSimError
from ppsim.ir import Action, Schedule
from ppsim.result import SimResult
from ppsim.schedules._phases import loop_placement, make_schedule, v_placement
from ppsim.search import cpsat
from ppsim.search.bounds import lower_bound, pair_saving, smallest_cap
from ppsim.search.common import (
    SEARCH_NAME,
    MemoryCap,
    MemoryCapError,
    NamedResult,
    Placement,
    Progress,
    SearchResult,
    Solver,
    fits,
    is_v,
    parse_memory_cap,
    peak_of,
    problem_for,
)
from ppsim.search.listsched import Problem, Rule, list_schedule
from ppsim.search.local import local_search
from ppsim.search.rules import fixed_rules, mutate, pairs_help, random_rule
from ppsim.search.seeds import loop_greedy_seeds, v_auto_seeds, v_block_seeds, v_greedy_seeds
from ppsim.split import SplitError

SETUP_GRACE_S = 1.0
"""The named schedules are timed even past the time limit by up to this much (fixed start-up costs), so that a
short limit still compares against them; a set-up estimated longer than the limit is refused before it starts."""

Named = tuple[NamedResult, Schedule, SimResult]
Case = tuple[Schedule, StageCosts, Problem]
"""One placement's template, its costs and its list-scheduling problem."""


@dataclass
class _Best:
    makespan: float = math.inf
    schedule: Schedule | None = None
    source: str = ""


@dataclass
class _Run:
    """What the phases share: the cases, the cap, the clock, the best order so far and the orders tried."""

    cases: list[Case]
    cap: MemoryCap
    bounds: list[float]
    """Per case, the makespan no order of its placement can beat (the analytic bound, or CP-SAT's if higher)."""
    t0: float
    deadline: float
    rng: random.Random
    progress: Callable[[Progress], None] | None
    best: _Best = field(default_factory=_Best)
    evaluations: int = 0
    last_report: float = 0.0
    seeds: list[tuple[float, Schedule]] = field(default_factory=list)
    """The best few seeds (makespan, order): local search starts from them too."""
    bound_source: str = "analytic"

    @property
    def lower_bound(self) -> float:
        return min(self.bounds)

    def optimal(self) -> bool:
        """The best order so far meets the lower bound: no order can be faster."""
        return self.best.makespan <= self.lower_bound * (1 + 1e-9) + 1e-12

    def report(self, phase: str, force: bool = False) -> None:
        now = time.perf_counter()
        if self.progress is not None and (force or now - self.last_report >= 0.5):
            self.last_report = now
            self.progress(Progress(now - self.t0, self.evaluations, self.best.makespan, self.lower_bound, phase))

    def costs_of(self, schedule: Schedule) -> StageCosts:
        return next(tcosts for tpl, tcosts, _ in self.cases if tpl.stage_to_rank == schedule.stage_to_rank)

    def take(self, schedule: Schedule, makespan: float, source: str) -> bool:
        """Keep ``schedule`` (already simulated and within the cap) if it beats the best so far."""
        if makespan >= self.best.makespan - 1e-9:
            return False
        self.best.makespan, self.best.schedule, self.best.source = makespan, schedule, source
        self.report(source, force=True)
        return True

    def consider(self, tpl: Schedule, orders: tuple[tuple[Action, ...], ...], makespan: float, source: str) -> bool:
        """A list-scheduled order: the simulator, not the list scheduler's own timing, judges it."""
        from ppsim.simulator import simulate

        if makespan >= self.best.makespan - 1e-9:
            return False
        candidate = tpl.with_actions(orders)
        sim = simulate(candidate, self.costs_of(tpl))
        if not fits(sim, self.cap):
            return False
        return self.take(candidate, sim.makespan, source)


def search(
    num_ranks: int,
    num_microbatches: int,
    costs: CostSpec | StageCosts | None = None,
    memory_cap: MemoryCap | str | float | None = None,
    *,
    placement: Placement | str = Placement.loop,
    num_stages_per_rank: int | None = None,
    time_limit: float = 10.0,
    seed: int = 0,
    cost_scope: str | None = None,
    max_orders: int | None = None,
    solver: Solver | str = Solver.auto,
    progress: Callable[[Progress], None] | None = None,
    allow_large: bool = False,
) -> SearchResult:
    """Search for the compute order with the smallest simulated makespan that fits ``memory_cap`` on every rank.

    ``memory_cap`` is a :class:`MemoryCap`, ``"8act"``, bytes (needs a profile's memory tables) or ``None``
    (no cap). ``placement``: ``loop`` (``num_stages_per_rank`` stages per rank, default 1), ``v`` (2 per rank in a
    V) or ``any``. ``cost_scope`` reads uniform costs per stage chunk (``"stage"``) or per rank share of the model
    (``"rank"``); by default per chunk, except that ``any`` (different stage counts) compares on the same model
    (``"rank"``), as :mod:`ppsim.compare` does. ``max_orders`` bounds the orders tried; the result is the same for
    the same ``seed`` whenever the clock is not what stops the search (``stopped != "time limit"``), e.g. with a
    ``max_orders`` small enough for the time limit (see docs/search.md). ``solver``: ``"auto"`` polishes with
    OR-Tools' CP-SAT when it is installed (``pip install ppsim[search]``), ``"cpsat"`` requires it, ``"none"``
    never uses it.

    The work is estimated first (:func:`ppsim.limits.estimate_search`): an order beyond the limit, or a set-up
    (timing the named schedules, a first order) that cannot fit ``time_limit``, is refused unless ``allow_large``.
    ``time_limit`` bounds the whole call, set-up included; ``progress`` hears of the set-up at once. Ctrl-C
    returns the best order so far (``stopped == "interrupted"``), or raises ``KeyboardInterrupt`` if there is none.
    """
    t0 = time.perf_counter()
    # Phase 0: set-up
    costs = as_spec(costs)
    cap = _check_inputs(num_ranks, num_microbatches, costs, memory_cap, time_limit, solver)
    templates = _templates(num_ranks, num_microbatches, Placement(placement), num_stages_per_rank)
    _check_work(templates, num_ranks, num_microbatches, time_limit, allow_large)
    cases, cost_scope = _cases(templates, costs, cap, cost_scope)
    _check_some_order_fits(cap, cases)
    run = _Run(cases, cap, [lower_bound(p) for _, _, p in cases], t0, t0 + time_limit, random.Random(seed),
               progress, last_report=t0)
    run.report("set-up", force=True)
    use_cpsat = _use_cpsat(solver) and (Solver(solver) is Solver.cpsat or not _is_big(templates))
    named = _named([tpl for tpl, _, _ in cases], num_ranks, num_microbatches, costs, cost_scope, cap, run=run)
    fitting = sorted((x for x in named if x[0].fits), key=lambda x: x[0].makespan)
    if fitting:
        run.best = _Best(fitting[0][0].makespan, fitting[0][1], fitting[0][0].name)
    stopped = "done"
    try:
        # Phase 1: seeds, then list scheduling
        now = time.perf_counter()
        left = max(0.0, run.deadline - now)  # the shares are of the time the set-up left
        big = _is_big(templates)
        # a big order: one list-scheduling pass takes seconds and random rules rarely win there; the seeds and the
        # critical-chain local search get the time instead
        seeds_share, phase1_share = (0.3, 0.4) if big else (0.15, 0.3) if use_cpsat else (0.25, 0.6)
        _seeds(run, now + seeds_share * left, max_orders)
        phase1_end = now + phase1_share * left
        elites = _list_scheduling(run, phase1_end, None if max_orders is None else max(1, int(0.6 * max_orders)))
        starts = _local_starts(run, elites, fitting[0] if fitting else None, costs, cost_scope)
        # Phase 2: CP-SAT
        if use_cpsat and starts and not run.optimal() and run.deadline - time.perf_counter() > 0.3:
            _cpsat_polish(run, starts, seed=seed, max_orders=max_orders)
        # Phase 3: local search (nothing to gain once the best order meets the bound)
        if not run.optimal():
            _local_phase(run, starts, max_orders, big=big)
        if time.perf_counter() >= run.deadline and not run.optimal():
            stopped = "time limit"
    except KeyboardInterrupt:
        stopped = "interrupted"
    # Phase 4: the result
    return _result(run, fitting, named, costs, cost_scope, stopped=stopped, seed=seed)


# --- Phase 0: set-up -------------------------------------------------------------------------------------------------
def _check_inputs(
    num_ranks: int, num_microbatches: int, costs: CostSpec, memory_cap: MemoryCap | str | float | None,
    time_limit: float, solver: Solver | str,
) -> MemoryCap:
    """Sizes, time limit, solver and cap checked before any work; returns the cap."""
    if num_ranks < 1 or num_microbatches < 1:
        raise PPSimError(f"--ranks {num_ranks} --mb {num_microbatches}: need at least 1 of each; e.g. -r 4 -m 8")
    if not math.isfinite(time_limit) or time_limit <= 0:
        raise PPSimError(f"--time-limit {time_limit}: must be a positive number of seconds; e.g. --time-limit 10")
    if solver not in ("auto", "cpsat", "none"):
        raise PPSimError(f"--solver {solver!r}: choose auto, cpsat or none")
    cap = MemoryCap(math.inf, "act") if memory_cap is None else parse_memory_cap(memory_cap)
    if cap.unit == "bytes" and not costs.has_memory:
        raise MemoryCapError(
            f"--memory-cap {memory_cap}: a cap in bytes needs activation sizes; pass --profile P.json "
            "or give the cap as activations (e.g. 8act)"
        )
    return cap


def _check_work(templates: list[Schedule], num_ranks: int, num_microbatches: int, time_limit: float,
                allow_large: bool) -> None:
    """Refuse, before any work, a search whose orders or set-up are beyond :mod:`ppsim.limits`."""
    from ppsim.limits import check_search, estimate_search
    from ppsim.schedules import all_specs

    stages = tuple(t.num_stages_per_rank for t in templates)
    estimate = estimate_search(num_ranks, num_microbatches, stages, num_named=len(all_specs()))
    check_search(estimate, time_limit=time_limit, allow_large=allow_large)


def _use_cpsat(solver: Solver | str) -> bool:
    solver = Solver(solver).value
    if solver == "cpsat" and not cpsat.available():
        raise PPSimError("--solver cpsat needs OR-Tools; pip install 'ppsim[search]' (or ortools), or drop --solver")
    return solver == "cpsat" or (solver == "auto" and cpsat.available())


def _is_big(templates: list[Schedule]) -> bool:
    """An order above :data:`CPSAT_MAX_COMPUTATIONS` computations (stages x microbatches x 3)."""
    return max(3 * t.num_stages * t.num_microbatches for t in templates) > CPSAT_MAX_COMPUTATIONS


def _templates(num_ranks: int, num_microbatches: int, placement: Placement, v: int | None) -> list[Schedule]:
    out: list[Schedule] = []
    empty: list[list[Action]] = [[] for _ in range(num_ranks)]
    if placement in (Placement.loop, Placement.any):
        vv = 1 if v is None else v
        if vv < 1:
            raise PPSimError(f"--stages-per-rank {vv}: need at least 1 stage per rank; pass -v 1 or more")
        out.append(make_schedule(SEARCH_NAME, empty, loop_placement(num_ranks, vv), num_microbatches, vv))
    if placement in (Placement.v, Placement.any):
        if placement is Placement.v and v not in (None, 2):
            raise PPSimError(f"--stages-per-rank {v}: V placement always has 2 stages per rank; drop -v or pass -v 2")
        out.append(make_schedule(SEARCH_NAME, empty, v_placement(num_ranks), num_microbatches, 2))
    return out


def _cases(
    templates: list[Schedule], costs: CostSpec, cap: MemoryCap, cost_scope: str | None
) -> tuple[list[Case], str]:
    """One case per placement the costs can describe (a profile fixes the stage count), and the cost scope."""
    scope = resolve_scope(templates, costs, cost_scope)[0].value  # the comparability rule of ppsim.compare
    cases: list[Case] = []
    errors: list[PPSimError] = []
    for tpl in templates:
        try:
            tcosts = costs.for_schedule(tpl, scope=scope)
        except SplitError:  # a split that cannot cut this chain is the user's to fix, not a placement to skip
            raise
        except PPSimError as exc:  # a profile fixes the stage count: keep the placements it describes
            errors.append(exc)
            continue
        cases.append((tpl, tcosts, problem_for(tpl, tcosts, cap)))
    if not cases:
        raise errors[0]
    return cases, scope


def _named(
    templates: list[Schedule], num_ranks: int, num_microbatches: int, costs: CostSpec, scope: str, cap: MemoryCap,
    *, run: _Run | None = None,
) -> list[Named]:
    """Every named schedule of the templates' placements, simulated under the same costs, with its peak (with a
    ``run``: reported as set-up, and only while its clock allows)."""
    from ppsim.schedules import all_specs, get_schedule
    from ppsim.simulator import simulate

    placements = {t.stage_to_rank for t in templates}
    out: list[Named] = []
    for spec in all_specs():
        vs = (
            [spec.fixed_stages_per_rank]
            if spec.fixed_stages_per_rank
            else sorted({t.num_stages_per_rank for t in templates})
        )
        for v in vs:
            if run is not None:
                if time.perf_counter() >= run.deadline + SETUP_GRACE_S:
                    return out  # the time limit bounds the set-up too
                run.report("set-up")
            try:
                sched = get_schedule(spec.name, num_ranks, num_microbatches, v)
                if sched.stage_to_rank not in placements or len(sched.pipelines) != 1:
                    continue
                sim = simulate(sched, costs.for_schedule(sched, scope=scope))
            except PPSimError:
                continue
            peak = peak_of(sim, cap.unit)
            out.append(
                (NamedResult(spec.name, sim.makespan, sim.bubble_ratio, peak, peak <= cap.amount + 1e-9, v), sched, sim)
            )
    return out


def _check_some_order_fits(cap: MemoryCap, cases: list[Case]) -> None:
    """Refuse, before any work, a cap below one microbatch's activations on all of a rank's stages (no order, named
    or searched, can hold less)."""
    need = min(smallest_cap(p) for _, _, p in cases)
    if need > cap.amount + 1e-9:
        shown = f"{need:g}act" if cap.unit == "act" else f"{int(math.ceil(need))} bytes"
        raise MemoryCapError(
            f"--memory-cap {cap}: no order fits; every rank must hold at least one microbatch's activations on all "
            f"its stages; the smallest feasible cap is {shown}; pass --memory-cap {shown.replace(' bytes', '')} or more"
        )


# --- Phase 1: seeds and list scheduling -----------------------------------------------------------------------------
SEED_SOURCE = "V building block"
LOOP_SEED_SOURCE = "zero-bubble greedy"
V_AUTO_SOURCE = "zero-bubble V auto"
"""Where a seed order came from (``SearchResult.source``): ppsim's V seeds, the authors' greedy for one stage per
rank, or the authors' automatic V schedule."""


def _seeds(run: _Run, phase_end: float, max_count: int | None) -> None:
    """The seed orders that fit the cap; the best two become local-search starts. One stage per rank: the
    zero-bubble authors' greedy auto-scheduler (a few milliseconds per variant). V placement: the authors'
    automatic V schedule (up to half the phase), the greedy V orders and ppsim's V building blocks; at ZBV's 2R
    (where the greedy V completes, and beats the authors' blocks) the greedy goes first, else the authors' blocks,
    then ppsim's (below 2R the greedy rarely completes, and a big order's blocks take the whole phase)."""
    now = time.perf_counter()
    for tpl, tcosts, prob in run.cases:
        loop = ((LOOP_SEED_SOURCE, s) for s in loop_greedy_seeds(tpl, tcosts, prob, run.cap, deadline=phase_end))
        auto = ((V_AUTO_SOURCE, s) for s in v_auto_seeds(tpl, tcosts, prob, run.cap, max_count=max_count,
                                                          deadline=now + 0.5 * (phase_end - now)))
        blocks = ((SEED_SOURCE, s) for s in v_block_seeds(tpl, tcosts, prob, run.cap, deadline=phase_end,
                                                           max_count=max_count))
        greedy = ((SEED_SOURCE, s) for s in v_greedy_seeds(tpl, tcosts, prob, run.cap, deadline=phase_end))
        at_2r = run.cap.unit != "act" or run.cap.amount >= 2 * tpl.num_ranks
        for source, (schedule, sim) in chain(loop, greedy, auto, blocks) if at_2r else chain(loop, auto, blocks,
                                                                                             greedy):
            if run.optimal():
                return
            run.evaluations += 1
            run.take(schedule, sim.makespan, source)
            run.seeds.append((sim.makespan, schedule))
            run.seeds.sort(key=lambda x: x[0])
            del run.seeds[2:]
            run.report(source)


Elite = tuple[float, int, Rule, Schedule]
"""A good list-scheduled order: makespan, when it was found, the rule that made it, the order."""


def _list_scheduling(run: _Run, phase_end: float, max_orders: int | None) -> list[list[Elite]]:
    """The fixed rules on every case, then random rules (half of them mutations of an elite's rule) until
    ``phase_end``, ``max_orders`` or 4,000 orders without a gain. Returns each case's best few orders."""
    elites: list[list[Elite]] = [[] for _ in run.cases]
    for k, (tpl, tcosts, prob) in enumerate(run.cases):
        allow_pairs = is_v(tpl) and pairs_help(tcosts, tpl)
        for rule in fixed_rules(prob, allow_pairs=allow_pairs):
            if run.best.schedule is not None and (time.perf_counter() >= phase_end or run.optimal()):
                break
            _try_rule(run, elites, k, rule)
            run.report("list scheduling")
    turn = 0
    stale = 0
    while (time.perf_counter() < phase_end and stale < 4000 and not run.optimal()
           and (max_orders is None or run.evaluations < max_orders)):
        k = turn % len(run.cases)
        turn += 1
        tpl, tcosts, prob = run.cases[k]
        rule = random_rule(run.rng, prob, allow_pairs=is_v(tpl) and pairs_help(tcosts, tpl))
        if elites[k] and run.rng.random() < 0.5:  # mutation: one setting of a good rule replaced by the fresh rule's
            rule = mutate(run.rng.choice(elites[k])[2], rule, run.rng)
        stale += 1
        if _try_rule(run, elites, k, rule):
            stale = 0
        run.report("list scheduling")
    return elites


def _try_rule(run: _Run, elites: list[list[Elite]], k: int, rule: Rule) -> bool:
    """List-schedule case ``k`` with ``rule``; keep the order among the case's elites; True if it is the best yet."""
    tpl, _, prob = run.cases[k]
    out = list_schedule(prob, rule, deadline=run.deadline)  # one pass of a big case may outlast the time limit
    run.evaluations += 1
    if out is None or max(out[2]) > run.cap.amount + 1e-9:
        return False
    elite = elites[k]
    if all(abs(e[0] - out[1]) > 1e-9 for e in elite):
        elite.append((out[1], run.evaluations, rule, tpl.with_actions(out[0])))
        elite.sort(key=lambda e: (e[0], e[1]))
        del elite[4:]
    return run.consider(tpl, out[0], out[1], "list scheduling")


def _local_starts(
    run: _Run, elites: list[list[Elite]], best_named: Named | None, costs: CostSpec, scope: str
) -> list[tuple[Schedule, StageCosts]]:
    """The orders local search starts from: each case's best three, the best two seeds and the best named one,
    fastest first (their makespans are known: nothing is simulated again)."""
    timed = [(e[0], e[3], run.cases[k][1]) for k, elite in enumerate(elites) for e in elite[:3]]
    timed += [(makespan, schedule, run.costs_of(schedule)) for makespan, schedule in run.seeds]
    if best_named is not None:
        timed.append((best_named[0].makespan, best_named[1], costs.for_schedule(best_named[1], scope=scope)))
    timed.sort(key=lambda x: x[0])
    return [(schedule, tcosts) for _, schedule, tcosts in timed]


# --- Phase 2: CP-SAT -------------------------------------------------------------------------------------------------
CPSAT_MAX_COMPUTATIONS = 8000
"""Above this many computations (stages x microbatches x 3) CP-SAT (``--solver auto``) is skipped: building its model
alone takes much of a minute (R=32, M=128, V: 24,576 computations, 26 s for no gain) and the time goes to the other
phases; ``--solver cpsat`` still runs it."""


def _cpsat_polish(run: _Run, starts: list[tuple[Schedule, StageCosts]], *, seed: int, max_orders: int | None) -> None:
    """CP-SAT from the best start: its answer, re-simulated with the exact costs, becomes the first start; where its
    model covers every order (:func:`ppsim.search.cpsat.provable`) its bound tightens the case's lower bound."""
    from ppsim.simulator import simulate

    sched, tcosts = starts[0]
    k = next((k for k, (t, _, _) in enumerate(run.cases) if t.stage_to_rank == sched.stage_to_rank), None)
    if k is None:
        return
    prob = run.cases[k][2]
    tpl = prob.template
    saving = max(pair_saving(prob, tpl.stages_of(r)) for r in range(tpl.num_ranks))
    run.report("CP-SAT", force=True)
    sim0 = simulate(sched, tcosts)
    outcome = cpsat.polish(
        prob, sched, sim0.starts, time_limit=0.6 * (run.deadline - time.perf_counter()), seed=seed,
        deterministic_time=None if max_orders is None else max(1.0, max_orders / 200),
        prove=run.cap.unit == "act" and cpsat.provable(prob, pair_saving=saving),
    )
    run.evaluations += 1
    if outcome.bound is not None and outcome.bound > run.bounds[k]:
        run.bounds[k] = outcome.bound
        run.bound_source = "CP-SAT"
    found = outcome.schedule
    if found is None:
        return
    try:
        fsim = simulate(found, tcosts)
    except PPSimError:
        return
    if fits(fsim, run.cap):
        starts.insert(0, (found, tcosts))
        run.take(found, fsim.makespan, "CP-SAT")


# --- Phase 3: local search -------------------------------------------------------------------------------------------
def _local_phase(run: _Run, starts: list[tuple[Schedule, StageCosts]], max_orders: int | None, *, big: bool) -> None:
    """Local search from each start in turn; the time (and orders) left are shared among the starts left (on a
    ``big`` order the best start gets half, and nine moves in ten are on the critical chain)."""
    from ppsim.simulator import simulate

    for k, (sched, tcosts) in enumerate(starts):
        if time.perf_counter() >= run.deadline:
            break
        left = len(starts) - k
        # the best start gets half the time on a big order (one move is a whole simulation there), else an even share
        share = (run.deadline - time.perf_counter()) / (2 if big and k == 0 and left > 1 else left)
        tries = None if max_orders is None else max(0, (max_orders - run.evaluations) // left)
        improved, n = local_search(sched, tcosts, run.cap, run.rng, time.perf_counter() + share, run.report, tries,
                                   chain_share=0.9 if big else 0.5)
        run.evaluations += n
        sim = simulate(improved, tcosts)
        if fits(sim, run.cap):
            run.take(improved, sim.makespan, "local search")


# --- Phase 4: the result ------------------------------------------------------------------------------------------
def _no_order_message(cap: MemoryCap, named: list[Named]) -> str:
    """The error when no order fitting ``cap`` was found in time: the smallest cap an order the search knows fits
    (the named schedule with the lowest peak), so the user can pick it rather than guess."""
    head = f"--memory-cap {cap}: no order found within the time limit"
    if not named:
        return f"{head}; raise --time-limit or the cap"
    lowest = min(named, key=lambda x: (x[0].peak, x[0].makespan))[0]
    shown = f"{lowest.peak:g}act" if cap.unit == "act" else f"{int(math.ceil(lowest.peak))}"
    return (f"{head}; the smallest cap known to fit is {shown} ({lowest.name}'s peak, makespan {lowest.makespan:g}); "
            f"raise --time-limit or pass --memory-cap {shown}")


def _result(
    run: _Run, fitting: list[Named], named: list[Named], costs: CostSpec, scope: str, *, stopped: str, seed: int
) -> SearchResult:
    """The best order, re-simulated; never worse than the best named schedule that fits."""
    from ppsim.simulator import simulate

    best = run.best
    if best.schedule is None and stopped == "interrupted":
        raise KeyboardInterrupt  # no order yet
    if best.schedule is None:
        raise MemoryCapError(_no_order_message(run.cap, named))
    result_sched, source = best.schedule, best.source
    if source in ("list scheduling", "local search", "CP-SAT", SEED_SOURCE, LOOP_SEED_SOURCE, V_AUTO_SOURCE):
        result_sched = replace(result_sched, name=SEARCH_NAME)
    sim = simulate(result_sched, costs.for_schedule(result_sched, scope=scope))
    if fitting and (sim.makespan > fitting[0][0].makespan + 1e-9 or not fits(sim, run.cap)):
        result_sched, sim, source = fitting[0][1], fitting[0][2], fitting[0][0].name
    return SearchResult(
        schedule=result_sched,
        sim=sim,
        makespan=sim.makespan,
        peak=peak_of(sim, run.cap.unit),
        cap=run.cap,
        lower_bound=run.lower_bound,
        named=tuple(n for n, _, _ in named),
        start=fitting[0][0].name if fitting else None,
        source=source,
        evaluations=run.evaluations,
        elapsed_s=time.perf_counter() - run.t0,
        stopped=stopped,
        seed=seed,
        cost_scope=scope,
        optimal=sim.makespan <= run.lower_bound * (1 + 1e-9) + 1e-12,
        bound_source=run.bound_source,
    )
