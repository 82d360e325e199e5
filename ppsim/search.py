"""Schedule search: the fastest order found for given costs under a per-rank memory cap.

Method (see docs/search.md):

1. Every named schedule whose placement matches is simulated; those that fit the cap are the baseline, and the best
   of them is a starting point.
2. Memory-aware list scheduling (:mod:`ppsim.schedules._greedy`) with a handful of fixed priority rules, then with
   random rules (admission limits per rank, when deferred W run, B or I+W, overlapped pairs) until the time limit.
3. Local search on the best orders: single actions moved within their rank's order, each candidate re-simulated by
   :func:`ppsim.simulate` (the judge), kept when the makespan drops and every rank still fits the cap.
4. With OR-Tools installed (``pip install ppsim[search]``), CP-SAT polishes the best order before the local search
   (:mod:`ppsim._search_cpsat`); without it the search works the same, minus that step. The result is never worse
   than the best named schedule that fits.

The lower bound (:func:`lower_bound`) is, for each rank, its busy time plus the idle time it cannot avoid at the
start (no backward can reach it before the first microbatch has gone down the chain and back, and until then it can
only run as many forwards as its memory holds) and at the end (after its last backward, only deferred W can run
while the last gradient travels to the first stage). Deterministic for a seed; honours a time limit; Ctrl-C returns
the best so far.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

from ppsim.compare import resolve_scope
from ppsim.costs import CostModel, costs_for, parse_costs
from ppsim.errors import PPSimError
from ppsim.ir import Action, ActionType, Schedule
from ppsim.result import SimResult
from ppsim.schedules._greedy import Problem, Rule, list_schedule, make_problem
from ppsim.schedules._phases import loop_placement, make_schedule, v_placement

SEARCH_NAME = "Searched"


class Placement(str, Enum):
    """Where stages live: ``loop`` (stage s on rank s % R), ``v`` (rank r holds r and 2R-1-r), ``any`` (both)."""

    loop = "loop"
    v = "v"
    any = "any"


class Solver(str, Enum):
    """Whether to polish with CP-SAT: when OR-Tools is importable (``auto``), always (``cpsat``), never."""

    auto = "auto"
    cpsat = "cpsat"
    none = "none"


class MemoryCapError(PPSimError):
    """A memory cap is malformed, needs a profile, or is too small for any order."""


@dataclass(frozen=True)
class MemoryCap:
    """A per-rank memory cap: ``amount`` activations (``unit="act"``) or bytes (``unit="bytes"``).

    One activation is what :func:`ppsim.simulate` counts in ``peak_activations``: one microbatch's saved
    activations of one stage. A rank holding several stages (chunks) holds one per chunk and microbatch.
    """

    amount: float
    unit: str = "act"

    def __str__(self) -> str:
        return f"{self.amount:g}act" if self.unit == "act" else f"{int(self.amount)}B"


def parse_memory_cap(text: str | int | float | MemoryCap) -> MemoryCap:
    """``"8act"`` (activations, see :class:`MemoryCap`) or a byte size (``80GiB``, ``1.5e9``), as
    :func:`ppsim.io.parse_memory_cap` reads them; a number is bytes."""
    from ppsim.io import ActivationCap
    from ppsim.io import parse_memory_cap as parse

    if isinstance(text, MemoryCap):
        return text
    if isinstance(text, (int, float)):
        if text <= 0:
            raise MemoryCapError(f"--memory-cap {text}: must be positive; e.g. 80GiB or 8act")
        return MemoryCap(float(int(text)), "bytes")
    cap = parse(text)
    assert cap is not None
    if isinstance(cap, ActivationCap):
        return MemoryCap(float(cap.count), "act")
    return MemoryCap(float(cap), "bytes")


@dataclass(frozen=True)
class NamedResult:
    """One named schedule under the same costs: makespan, bubble and peak memory (in the cap's unit)."""

    name: str
    makespan: float
    bubble_ratio: float
    peak: float
    fits: bool
    num_stages_per_rank: int


@dataclass(frozen=True)
class Progress:
    """Reported to the progress callback when the best order improves and every so often."""

    elapsed_s: float
    evaluations: int
    best_makespan: float
    lower_bound: float
    phase: str


@dataclass(frozen=True)
class SearchResult:
    """The best order found, how it compares, and how the search went."""

    schedule: Schedule
    sim: SimResult
    makespan: float
    peak: float
    cap: MemoryCap
    lower_bound: float
    named: tuple[NamedResult, ...]
    start: str | None
    """The best named schedule that fits (the starting point), or ``None``."""
    source: str
    """What produced the returned order: ``"list scheduling"``, ``"local search"``, or a named schedule's name."""
    evaluations: int
    elapsed_s: float
    stopped: str
    """``"done"``, ``"time limit"`` or ``"interrupted"``."""
    seed: int
    cost_scope: str = "stage"
    """How uniform costs were read: per stage chunk or per rank share (see :func:`search`)."""

    @property
    def gap(self) -> float:
        """Relative distance to the lower bound (0.05 = 5 % above it)."""
        if self.lower_bound <= 0:
            return 0.0
        return max(0.0, self.makespan / self.lower_bound - 1.0) if self.makespan >= self.lower_bound - 1e-9 * \
            self.lower_bound else self.makespan / self.lower_bound - 1.0

    @property
    def bubble_ratio(self) -> float:
        return self.sim.bubble_ratio

    @property
    def best_named(self) -> NamedResult | None:
        fitting = [n for n in self.named if n.fits]
        return min(fitting, key=lambda n: n.makespan) if fitting else None

    def to_dict(self) -> dict[str, object]:
        best = self.best_named
        return {
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "peak": self.peak,
            "cap": str(self.cap),
            "cap_unit": self.cap.unit,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "source": self.source,
            "num_stages_per_rank": self.schedule.num_stages_per_rank,
            "placement": "v" if _is_v(self.schedule) else "loop",
            "best_named": None if best is None else best.name,
            "named": [n.__dict__ for n in self.named],
            "evaluations": self.evaluations,
            "elapsed_s": self.elapsed_s,
            "stopped": self.stopped,
            "seed": self.seed,
            "cost_scope": self.cost_scope,
            "csv": self.schedule.to_rows(),
        }


def _is_v(schedule: Schedule) -> bool:
    return schedule.num_stages == 2 * schedule.num_ranks and schedule.stage_to_rank == v_placement(schedule.num_ranks)


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


def _peak(sim: SimResult, unit: str) -> float:
    if unit == "bytes":
        return float(max((p.peak_memory_bytes or 0) for p in sim.per_rank))
    return float(max(p.peak_activations for p in sim.per_rank))


def _fits(sim: SimResult, cap: MemoryCap) -> bool:
    return _peak(sim, cap.unit) <= cap.amount + 1e-9


def _problem(template: Schedule, costs: CostModel, cap: MemoryCap) -> Problem:
    return make_problem(template, costs, cap.amount, unit=cap.unit)


def lower_bound(problem: Problem) -> float:
    """A makespan no order can beat under ``problem``'s costs and memory cap (see the module docstring)."""
    tpl = problem.template
    M = tpl.num_microbatches
    chain = tpl.pipelines[0]
    f, w = problem.f, problem.w
    bi = [min(problem.i[s], problem.b[s]) for s in range(tpl.num_stages)]
    bw = [min(problem.b[s], problem.i[s] + problem.w[s]) for s in range(tpl.num_stages)]
    # earliest forward start and earliest backward start of every stage (microbatch 0 alone)
    ef: dict[int, float] = {}
    t = 0.0
    for k, s in enumerate(chain):
        ef[s] = t
        t += f[s] + problem.fwd_delay[s]
    last = chain[-1]
    eb: dict[int, float] = {last: ef[last] + f[last]}
    for k in range(len(chain) - 2, -1, -1):
        s, n = chain[k], chain[k + 1]
        eb[s] = eb[n] + bi[n] + problem.bwd_delay[s]
    # time from the end of a backward of stage s to the end of the first stage's work on that microbatch
    down: dict[int, float] = {chain[0]: 0.0}
    acc = bw[chain[0]] + problem.bwd_delay[chain[0]]
    for k in range(1, len(chain)):
        s = chain[k]
        down[s] = acc
        acc += bi[s] + problem.bwd_delay[s]
    best = eb[chain[0]] + bw[chain[0]]
    for r in range(tpl.num_ranks):
        stages = tpl.stages_of(r)
        # an overlapped pair (a forward with another stage's backward) may take less than its halves apart
        save = _pair_saving(problem, stages)
        work = M * sum(f[s] + bw[s] for s in stages) - M * len(stages) * save
        cap = problem.cap[r]
        min_act = min(problem.act[s] for s in stages)
        n_f = M * len(stages) if min_act <= 0 or cap == math.inf else min(M * len(stages), int(cap // min_act + 1e-9))
        held_w = min(problem.act[s] - problem.freed_by_i[s] for s in stages)
        n_w = M * len(stages) if held_w <= 0 or cap == math.inf else min(M * len(stages), int(cap // held_w + 1e-9))
        head = max(min(ef[s] for s in stages), min(eb[s] for s in stages) - n_f * max(f[s] for s in stages))
        tail = max(0.0, min(down[s] for s in stages) - n_w * max(w[s] for s in stages))
        best = max(best, head + work + tail)
        # Memory-bound admission: the last microbatch to enter the rank can start its forward only once the rank
        # has run every other entry forward and released enough memory (a B or an I + W releases a whole
        # activation, an I alone the part it frees), and then must still go down the chain, back up, and end with
        # the first stage's backward.
        entry = min(stages, key=chain.index)
        if cap < math.inf and problem.act[entry] > 0 and M * problem.act[entry] > cap:
            rate = min(
                min(max(bw[s] - save, 0.0) / problem.act[s],
                    max(bi[s] - save, 0.0) / problem.freed_by_i[s] if problem.freed_by_i[s] > 0 else math.inf)
                for s in stages
            )
            last_in = head + (M - 1) * f[entry] + (M * problem.act[entry] - cap) * rate
            best = max(best, last_in + eb[chain[0]] + bw[chain[0]] - ef[entry])
    return best


def _pair_saving(problem: Problem, stages: list[int] | tuple[int, ...]) -> float:
    """The most one overlapped pair on these stages can save against running its forward and backward apart
    (0 when the costs make a pair no cheaper, as with uniform costs and FB = F + B)."""
    if len(stages) < 2:
        return 0.0
    tpl, costs = problem.template, problem.costs
    best = 0.0
    for s in stages:
        for bs in stages:
            if bs == s:
                continue
            for kind, alone in ((ActionType.B, problem.b[bs]), (ActionType.I, problem.i[bs])):
                best = max(best, problem.f[s] + alone - costs.pair_duration(tpl, s, bs, kind))
    return best


def smallest_cap(problem: Problem) -> float:
    """The least per-rank cap any order needs: one microbatch's activations on all of a rank's stages."""
    return max(problem.need(r) for r in range(problem.template.num_ranks))


def _named(
    templates: list[Schedule], num_ranks: int, num_microbatches: int, costs: CostModel, cap: MemoryCap, scope: str
) -> list[tuple[NamedResult, Schedule, SimResult]]:
    from ppsim.schedules import all_specs, get_schedule
    from ppsim.simulate import simulate

    placements = {t.stage_to_rank for t in templates}
    out = []
    for spec in all_specs():
        vs = [spec.fixed_stages_per_rank] if spec.fixed_stages_per_rank else sorted({t.num_stages_per_rank for t in templates})
        for v in vs:
            try:
                sched = get_schedule(spec.name, num_ranks, num_microbatches, v)
                if sched.stage_to_rank not in placements or len(sched.pipelines) != 1:
                    continue
                sim = simulate(sched, costs_for(costs, sched, scope=scope))
            except PPSimError:
                continue
            peak = _peak(sim, cap.unit)
            out.append(
                (NamedResult(spec.name, sim.makespan, sim.bubble_ratio, peak, peak <= cap.amount + 1e-9, v), sched, sim)
            )
    return out


def _random_rule(rng: random.Random, problem: Problem, *, allow_pairs: bool) -> Rule:
    R = problem.num_ranks
    cap_mb = [max(1, int(problem.cap[r] // max(problem.need(r), 1e-12))) if problem.cap[r] < math.inf else 10**6
              for r in range(R)]
    style = rng.random()
    inflight: tuple[int, ...] | None
    if style < 0.2:
        inflight = None
    else:
        a = rng.choice((0.5, 1.0, 1.0, 1.5, 2.0))
        b = rng.choice((-1, 0, 0, 1, 2, 3))
        inflight = tuple(max(1, min(cap_mb[r], round(a * (R - r) + b))) for r in range(R))
        if rng.random() < 0.3:
            inflight = tuple(max(1, min(cap_mb[r], x + rng.choice((-1, 0, 1)))) for r, x in enumerate(inflight))
    return Rule(
        backward=rng.choice(("split", "split", "auto", "fused")) if rng.random() < 0.4 else "split",
        backward_first=rng.random() < 0.85,
        w_fill=rng.choice(("eager", "fit")),
        w_keep=rng.choice((1 << 30, 1 << 30, 0, 1, 2, 4)),
        inflight=inflight,
        pairs=allow_pairs and rng.random() < 0.7,
        deep_first=rng.random() < 0.7,
        wait_b=rng.choice((0.0, 0.0, 0.25, 0.5, 1.0, 2.0)) * min(problem.f),
        reserve="one" if problem.template.num_stages_per_rank > 1 and rng.random() < 0.4 else "all",
        jitter=rng.randrange(1 << 30) if rng.random() < 0.5 else None,
    )


_RULE_FIELDS = ("backward", "backward_first", "w_fill", "w_keep", "inflight", "pairs", "deep_first", "wait_b",
                "reserve", "jitter")


def _mutate(rule: Rule, donor: Rule, rng: random.Random) -> Rule:
    """``rule`` with one setting taken from ``donor`` (for per-rank limits, sometimes one rank's only)."""
    name = rng.choice(_RULE_FIELDS)
    if name == "inflight" and rule.inflight is not None and donor.inflight is not None and rng.random() < 0.5:
        r = rng.randrange(len(rule.inflight))
        limits = list(rule.inflight)
        limits[r] = max(1, limits[r] + rng.choice((-1, 1)))
        return replace(rule, inflight=tuple(limits))
    return replace(rule, **{name: getattr(donor, name)})


def _fixed_rules(problem: Problem, *, allow_pairs: bool) -> list[Rule]:
    rules = []
    for pairs in ((False, True) if allow_pairs else (False,)):
        for w_fill in ("eager", "fit"):
            for backward in ("split", "auto"):
                for wait in (0.0, 0.5, 1.0):
                    rules.append(Rule(backward=backward, w_fill=w_fill, pairs=pairs, wait_b=wait * min(problem.f)))
                    if problem.template.num_stages_per_rank > 1:
                        rules.append(Rule(backward=backward, w_fill=w_fill, pairs=pairs, reserve="one",
                                          wait_b=wait * min(problem.f)))
    return rules


@dataclass
class _Best:
    makespan: float = math.inf
    schedule: Schedule | None = None
    source: str = ""


def search(
    num_ranks: int,
    num_microbatches: int,
    costs: CostModel | None = None,
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
    """
    from ppsim.simulate import simulate

    t0 = time.perf_counter()
    costs = parse_costs(None) if costs is None else costs
    placement = Placement(placement)
    if num_ranks < 1 or num_microbatches < 1:
        raise PPSimError(f"--ranks {num_ranks} --mb {num_microbatches}: need at least 1 of each; e.g. -r 4 -m 8")
    if time_limit <= 0:
        raise PPSimError(f"--time-limit {time_limit}: must be positive (seconds); e.g. --time-limit 10")
    cap = MemoryCap(math.inf, "act") if memory_cap is None else parse_memory_cap(memory_cap)
    if cap.unit == "bytes" and not costs.has_memory:
        raise MemoryCapError(
            f"--memory-cap {memory_cap}: a cap in bytes needs activation sizes; pass --profile P.json "
            "or give the cap as activations (e.g. 8act)"
        )
    templates = _templates(num_ranks, num_microbatches, placement, num_stages_per_rank)
    cost_scope = resolve_scope(templates, costs, cost_scope)[0].value  # the comparability rule of ppsim.compare
    problems = []
    errors: list[PPSimError] = []
    for tpl in templates:
        tcosts = costs_for(costs, tpl, scope=cost_scope)
        try:
            tcosts.check(tpl)
        except PPSimError as exc:  # a profile fixes the stage count: keep the placements it describes
            errors.append(exc)
            continue
        problems.append((tpl, tcosts, _problem(tpl, tcosts, cap)))
    if not problems:
        raise errors[0]
    templates = [tpl for tpl, _, _ in problems]
    named = _named(templates, num_ranks, num_microbatches, costs, cap, cost_scope)
    need = min(smallest_cap(p) for _, _, p in problems)
    if need > cap.amount + 1e-9 and not any(n.fits for n, _, _ in named):
        smallest = min([need] + [n.peak for n, _, _ in named])
        shown = f"{smallest:g}act" if cap.unit == "act" else f"{int(math.ceil(smallest))} bytes"
        raise MemoryCapError(
            f"--memory-cap {cap}: no order fits; every rank must hold at least one microbatch's activations on all "
            f"its stages; the smallest feasible cap is {shown}; pass --memory-cap {shown.replace(' bytes', '')} or more"
        )
    lb = min(lower_bound(p) for _, _, p in problems)
    best = _Best()
    start_name: str | None = None
    fitting = sorted((x for x in named if x[0].fits), key=lambda x: x[0].makespan)
    if fitting:
        start_name = fitting[0][0].name
        best = _Best(fitting[0][0].makespan, fitting[0][1], fitting[0][0].name)
    evaluations = 0
    stopped = "done"
    deadline = t0 + time_limit
    rng = random.Random(seed)
    last_report = [t0]

    def report(phase: str, force: bool = False) -> None:
        now = time.perf_counter()
        if progress is not None and (force or now - last_report[0] >= 0.5):
            last_report[0] = now
            progress(Progress(now - t0, evaluations, best.makespan, lb, phase))

    costs_of = {tpl.stage_to_rank: tcosts for tpl, tcosts, _ in problems}

    def consider(tpl: Schedule, orders: tuple[tuple[Action, ...], ...], makespan: float, source: str) -> bool:
        if makespan >= best.makespan - 1e-9:
            return False
        # the simulator judges: the list scheduler's own timing is the same model, but the simulator is the truth
        candidate = tpl.with_actions(orders)
        sim = simulate(candidate, costs_of[tpl.stage_to_rank])
        if sim.makespan >= best.makespan - 1e-9 or not _fits(sim, cap):
            return False
        best.makespan, best.schedule, best.source = sim.makespan, candidate, source
        report(source, force=True)
        return True

    try:
        # Phase 1: list scheduling, fixed rules then random rules (at most ~60 % of the budget).
        from ppsim import _search_cpsat

        if solver not in ("auto", "cpsat", "none"):
            raise PPSimError(f"--solver {solver!r}: choose auto, cpsat or none")
        solver = Solver(solver).value
        use_cpsat = solver == "cpsat" or (solver == "auto" and _search_cpsat.available())
        if solver == "cpsat" and not _search_cpsat.available():
            raise PPSimError("--solver cpsat needs OR-Tools; pip install 'ppsim[search]' (or ortools), "
                             "or drop --solver")
        phase1_end = t0 + (0.4 if use_cpsat else 0.6) * time_limit
        orders1 = None if max_orders is None else max(1, int(0.6 * max_orders))
        # per placement, the best few orders found by list scheduling and the rules that made them
        elites: list[list[tuple[float, int, Rule, Schedule]]] = [[] for _ in problems]

        def keep(k: int, rule: Rule, out: tuple) -> bool:  # type: ignore[type-arg]
            tpl = problems[k][0]
            elite = elites[k]
            if all(abs(e[0] - out[1]) > 1e-9 for e in elite):
                elite.append((out[1], evaluations, rule, tpl.with_actions(out[0])))
                elite.sort(key=lambda e: (e[0], e[1]))
                del elite[4:]
            return consider(tpl, out[0], out[1], "list scheduling")

        for k, (tpl, tcosts, prob) in enumerate(problems):
            allow_pairs = _is_v(tpl) and _pairs_help(tcosts, tpl)
            for rule in _fixed_rules(prob, allow_pairs=allow_pairs):
                if best.schedule is not None and time.perf_counter() >= phase1_end:
                    break
                out = list_schedule(prob, rule)
                evaluations += 1
                if out is not None and max(out[2]) <= cap.amount + 1e-9:
                    keep(k, rule, out)
        turn = 0
        stale = 0
        while time.perf_counter() < phase1_end and stale < 4000 and (orders1 is None or evaluations < orders1):
            k = turn % len(problems)
            turn += 1
            tpl, tcosts, prob = problems[k]
            rule = _random_rule(rng, prob, allow_pairs=_is_v(tpl) and _pairs_help(tcosts, tpl))
            if elites[k] and rng.random() < 0.5:
                # Mutation: one setting of a good rule replaced by the fresh rule's
                rule = _mutate(rng.choice(elites[k])[2], rule, rng)
            out = list_schedule(prob, rule)
            evaluations += 1
            stale += 1
            if out is not None and max(out[2]) <= cap.amount + 1e-9 and keep(k, rule, out):
                stale = 0
            report("list scheduling")
        # Phase 2: local search from the best few orders and the best named one, judged by the simulator.
        starts: list[tuple[Schedule, CostModel]] = [
            (e[3], problems[k][1]) for k, elite in enumerate(elites) for e in elite[:3]
        ]
        if fitting:
            sched = fitting[0][1]
            starts.append((sched, costs_for(costs, sched, scope=cost_scope)))
        starts.sort(key=lambda x: simulate(x[0], x[1]).makespan)
        if use_cpsat and starts and deadline - time.perf_counter() > 0.3:
            # Phase 2a: CP-SAT from the best order, its answer re-simulated with the exact costs.
            sched, tcosts = starts[0]
            prob = next((p for t, _, p in problems if t.stage_to_rank == sched.stage_to_rank), None)
            if prob is not None:
                report("CP-SAT", force=True)
                sim0 = simulate(sched, tcosts)
                budget = 0.5 * (deadline - time.perf_counter())
                found = _search_cpsat.polish(
                    prob, sched, sim0.starts, time_limit=budget, seed=seed,
                    deterministic_time=None if max_orders is None else max(1.0, max_orders / 200),
                )
                evaluations += 1
                if found is not None:
                    try:
                        fsim = simulate(found, tcosts)
                    except PPSimError:
                        fsim = None
                    if fsim is not None and _fits(fsim, cap):
                        starts.insert(0, (found, tcosts))
                        if fsim.makespan < best.makespan - 1e-9:
                            best.makespan, best.schedule, best.source = fsim.makespan, found, "CP-SAT"
                            report("CP-SAT", force=True)
        for k, (sched, tcosts) in enumerate(starts):
            if time.perf_counter() >= deadline:
                break
            left = len(starts) - k  # the time (and orders) left are shared among the starts left
            share = (deadline - time.perf_counter()) / left
            tries = None if max_orders is None else max(0, (max_orders - evaluations) // left)
            improved, n = _local_search(sched, tcosts, cap, rng, time.perf_counter() + share, report, tries)
            evaluations += n
            sim = simulate(improved, tcosts)
            if _fits(sim, cap):
                consider_s = sim.makespan < best.makespan - 1e-9
                if consider_s:
                    best.makespan, best.schedule, best.source = sim.makespan, improved, "local search"
                    report("local search", force=True)
        if time.perf_counter() >= deadline:
            stopped = "time limit"
    except KeyboardInterrupt:
        stopped = "interrupted"
    if best.schedule is None:
        raise MemoryCapError(
            f"--memory-cap {cap}: no order found within the time limit; raise --time-limit or the cap"
        )
    result_sched = best.schedule
    if best.source in ("list scheduling", "local search", "CP-SAT"):
        result_sched = replace(result_sched, name=SEARCH_NAME)
    tcosts = costs_for(costs, result_sched, scope=cost_scope)
    sim = simulate(result_sched, tcosts)
    if fitting and (sim.makespan > fitting[0][0].makespan + 1e-9 or not _fits(sim, cap)):
        # never worse than the best named schedule that fits
        result_sched, sim, best.source = fitting[0][1], fitting[0][2], fitting[0][0].name
    return SearchResult(
        schedule=result_sched,
        sim=sim,
        makespan=sim.makespan,
        peak=_peak(sim, cap.unit),
        cap=cap,
        lower_bound=lb,
        named=tuple(n for n, _, _ in named),
        start=start_name,
        source=best.source,
        evaluations=evaluations,
        elapsed_s=time.perf_counter() - t0,
        stopped=stopped,
        seed=seed,
        cost_scope=cost_scope,
    )


def _pairs_help(costs: CostModel, tpl: Schedule) -> bool:
    return any(
        costs.pair_duration(tpl, s, tpl.num_stages - 1 - s, ActionType.B)
        < costs.op_cost(tpl, s, ActionType.F) + costs.op_cost(tpl, tpl.num_stages - 1 - s, ActionType.B) - 1e-12
        for s in range(tpl.num_stages)
    )


def _score(sim: SimResult) -> tuple[float, float]:
    """Makespan first; then the sum of the ranks' finishing times, which rewards progress off the critical rank."""
    return sim.makespan, sum(max(ends, default=0.0) for ends in sim.ends)


def _local_search(
    schedule: Schedule,
    costs: CostModel,
    cap: MemoryCap,
    rng: random.Random,
    deadline: float,
    report: Callable[[str], None],
    max_tries: int | None = None,
) -> tuple[Schedule, int]:
    """First-improvement local search: move one action a few places earlier or later in its rank's order.

    A move is kept when it lowers the makespan, or keeps it and lowers the sum of the ranks' finishing times."""
    from ppsim.simulate import simulate

    current = schedule
    cur = _score(simulate(current, costs))
    n = 0
    failures = 0
    while time.perf_counter() < deadline and failures < 3000 and (max_tries is None or n < max_tries):
        rows = [list(r) for r in current.actions]
        r = rng.randrange(len(rows))
        if not rows[r]:
            failures += 1
            continue
        i = rng.randrange(len(rows[r]))
        step = rng.choice((-3, -2, -1, 1, 2, 3))
        j = i + step
        if not 0 <= j < len(rows[r]):
            failures += 1
            continue
        a = rows[r].pop(i)
        rows[r].insert(j, a)
        cand = current.with_actions(rows)
        n += 1
        try:
            csim = simulate(cand, costs)
        except PPSimError:  # a move that deadlocks (DeadlockError) or breaks the order
            failures += 1
            continue
        score = _score(csim)
        better = score[0] < cur[0] - 1e-9 or (score[0] <= cur[0] + 1e-9 and score[1] < cur[1] - 1e-9)
        if better and _fits(csim, cap):
            if score[0] < cur[0] - 1e-9:
                report("local search")
                failures = 0
            current, cur = cand, score
        else:
            failures += 1
    return current, n
