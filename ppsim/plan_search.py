"""`ppsim plan`'s search: the order in which candidates are judged within the time limit (:func:`plan`), and the
tools one plan call owns (no torch here: the caller passes the torch-side shape computation in).

- :class:`Simulations` simulates a candidate's order, loading each cost table once (per profile and split, or the
  unit costs of a checkpoint mode);
- :class:`ShapeCache` keeps the model's shapes per (TP degree, microbatch size, checkpoint mode): the expensive call,
  made by the caller's ``compute``;
- :class:`OrderSearch` asks :func:`ppsim.search.search` for a faster order than a named schedule, at no more
  activations per rank, and keeps each found order for its CSV;
- :class:`Budget` is the time limit, counted from when the command began, less a reserve for the output.

Each is made for one plan and dropped with it: nothing is cached between plans.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.errors import PPSimError
from ppsim.job.memory import GIB, with_job_memory
from ppsim.plan import (
    V_SHAPE,
    Build,
    Candidate,
    Judge,
    Judged,
    Plan,
    PlanError,
    PlanRequest,
    Prepared,
    ProfileCover,
    ShapesFor,
    Simulate,
    candidates,
    covering_profile,
    describe,
    global_batch,
    job_of,
    lower_bound,
    nothing_fits,
    shapes_of,
    unit_costs,
)

if TYPE_CHECKING:
    from ppsim.costs import CostSpec
    from ppsim.ir import Schedule
    from ppsim.job.memory import JobShapes
    from ppsim.result import SimResult


def build_named(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> Schedule:
    """A named schedule's order (:func:`ppsim.compare.build`)."""
    from ppsim.compare import build

    return build(name, ranks, microbatches, stages_per_rank)[0]


@dataclass(frozen=True)
class Simulations:
    """Simulating candidates' orders for one plan: each cost table loaded once."""

    _costs: dict[tuple[Any, Any], CostSpec] = field(default_factory=dict, repr=False)

    def costs(self, job: Any, profile: ProfileCover | None, unit: str) -> CostSpec:
        """The profile pass's costs cut at the job's split, or the unit costs (``F=1,B=2,...``)."""
        from ppsim.costs import CostSpec, load_costs

        key = (unit if profile is None else profile.key, None if profile is None else job.split)
        if key not in self._costs:
            self._costs[key] = load_costs(costs=unit) if profile is None else CostSpec.from_profile(
                profile.profile(), source=profile.path, split=job.split)
        return self._costs[key]

    def simulate(self, schedule: Schedule, job: Any, profile: ProfileCover | None, unit: str, *,
                 step: Callable[[Any, Any], Any] | None = None) -> SimResult:
        """The order's simulated step (seconds with a profile, else unit costs at stage scope), timed by the one
        step model where ``step`` is given (:func:`ppsim.plan.step_collectives`)."""
        from ppsim.compare import compare

        return compare([schedule.name], builder=lambda _: schedule, costs=self.costs(job, profile, unit),
                       scope=None if profile else "stage", step=step).best


@dataclass(frozen=True)
class ShapeCache:
    """``compute(tp, microbatch_size, activation_checkpoint)`` once per key (the model's TP-local shapes)."""

    compute: Callable[..., JobShapes]
    _cache: dict[tuple[Any, ...], JobShapes | PPSimError] = field(default_factory=dict, repr=False)

    def has(self, key: tuple[Any, ...]) -> bool:
        """Whether the shapes at a candidate's :attr:`~ppsim.plan.Candidate.shape_key` are made (or refused)."""
        tp, size, ac, *rest = key
        ep, cp = (rest + [1, 1])[:2]
        extra = sorted({k: v for k, v in (("ep", ep), ("cp", cp)) if v != 1}.items())
        return (tp, size, ac, *extra) in self._cache

    def __call__(self, tp: int, microbatch_size: int, activation_checkpoint: str, **degrees: int) -> JobShapes:
        """The shapes at this key (``degrees``: ``ep=``, ``cp=`` above 1); a key whose shapes cannot be made
        (one line: torchtitan refuses the degrees) raises the same error again without computing it again."""
        key = (tp, microbatch_size, activation_checkpoint, *sorted(degrees.items()))
        if key not in self._cache:
            try:
                self._cache[key] = self.compute(tp, microbatch_size, activation_checkpoint, **degrees)
            except PPSimError as exc:
                self._cache[key] = exc
        found = self._cache[key]
        if isinstance(found, PPSimError):
            raise found
        return found


@dataclass(frozen=True)
class OrderSearch:
    """``search``'s order for a configuration, at no more activations per rank than its named schedule holds; each
    found order kept under the CSV path it goes to (beside ``-o``, or in the current folder)."""

    simulations: Simulations
    folder: Path = Path(".")
    stem: str = "plan"
    orders: dict[str, Schedule] = field(default_factory=dict, repr=False)

    def __call__(self, named: Schedule, job: Any, profile: ProfileCover | None, unit: str, seconds: float,
                 c: Any) -> tuple[Schedule, str] | None:
        from ppsim.search import search

        base = self.simulations.simulate(named, job, profile, unit)
        peak = max(r.peak_activations for r in base.per_rank)
        v_shape = c.schedule in V_SHAPE
        try:
            found = search(named.num_ranks, named.num_microbatches, self.simulations.costs(job, profile, unit),
                           f"{peak}act", placement="v" if v_shape else "loop",
                           num_stages_per_rank=None if v_shape else c.num_stages_per_rank, time_limit=seconds,
                           solver="none", cost_scope=None if profile else "stage")
        except PPSimError:
            return None
        if found.makespan >= base.makespan * (1 - 1e-9):
            return None
        path = self.folder / f"{self.stem}_pp{named.num_ranks}_m{named.num_microbatches}_v{c.num_stages_per_rank}.csv"
        self.orders[str(path)] = found.schedule
        return found.schedule, str(path)


#: seconds kept from the limit for what follows the judging: whatever is printed (the table, the launch line) and
#: the process's exit (1.4-2.7 s with torchtitan loaded, llama3_70b on the 2-core VM), per judged candidate (its
#: JSON row) and for an HTML page (plotly, the best's Gantt chart: 0.2 s there); at most a quarter of the limit
OUTPUT_BASE_S = 2.5
OUTPUT_ROW_S = 0.002
OUTPUT_PAGE_S = 1.0


@dataclass(frozen=True)
class Budget:
    """The time limit of the whole command: counted from ``started`` (``time.monotonic()`` when the process or the
    command began), less a reserve for printing what was found, scaled to how much there is to print."""

    started: float
    limit_s: float
    page: bool = False
    """An HTML page follows the plan."""
    spent: dict[str, list[float]] = field(default_factory=dict, repr=False, compare=False)
    """Seconds each kind of step took (``shape``, ``time``): what the next one is expected to take."""

    def reserve_s(self, rows: int) -> float:
        wanted = OUTPUT_BASE_S + OUTPUT_ROW_S * rows + (OUTPUT_PAGE_S if self.page else 0.0)
        return min(0.25 * self.limit_s, wanted)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def left_s(self, rows: int, *, share: float = 1.0) -> float:
        """Seconds left for judging (``share`` of the judging time: the named orders leave some to the search)."""
        return share * (self.limit_s - self.reserve_s(rows)) - self.elapsed_s()

    def affords(self, rows: int, kind: str | None = None, *, share: float = 1.0) -> bool:
        """Whether a step of ``kind`` (as long as those of its kind so far took on average) ends within the time
        left: a step cannot be cut short, so one that would overrun is not begun."""
        spent = self.spent.get(kind or "", [])
        return self.left_s(rows, share=share) > (sum(spent) / len(spent) if spent else 0.0)

    def measured(self, kind: str, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step``, recording how long each call takes under ``kind``."""

        def run(*args: Any, **kw: Any) -> Any:
            begun = time.monotonic()
            try:
                return step(*args, **kw)
            finally:
                self.spent.setdefault(kind, []).append(time.monotonic() - begun)

        return run


# --- the plan --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanProgress:
    """Where a plan is: its phase (``memory``, ``timing``, ``orders``), how far through it, the best so far."""

    phase: str
    done: int
    total: int
    fitting: int
    best: Judged | None
    elapsed_s: float


Progress = Callable[[PlanProgress], None]
Searcher = Callable[[Any, Any, "ProfileCover | None", str, float, Candidate], "tuple[Any, str] | None"]
"""``searcher(named_schedule, job, profile, unit_costs, seconds, candidate) -> (order, csv path) | None``: a faster
order than the named one for the same configuration, at no more activations per rank, and where its CSV goes
(:class:`ppsim.plan_search.OrderSearch`)."""
NUM_SEARCHED = 3
SEARCH_SHARE = 0.8
NAMED_SHARE = 0.75
"""The share of the judging time the named orders may take when searched orders follow."""
MEMORY_SHARE = 0.6
"""Once a candidate fits, judging memory stops at this share of the named orders' time, leaving the rest for timing."""


class PlanStopped(Exception):
    """The time limit stopped the plan before any candidate that fits was timed (one line; not the cap's fault)."""


@dataclass
class _Found:
    """What one plan call has found so far (it grows as the plan goes, so Ctrl-C keeps it): every verdict in
    the order memory was judged in, the timed ones, the best one's simulated step, and why judging stopped."""

    judged: list[Judged] = field(default_factory=list)
    timed: list[Judged] = field(default_factory=list)
    best_sim: Any = None
    stopped: str = ""
    pruned: int = 0
    memory_done: int = 0

    def add_timed(self, j: Judged, sim: Any) -> None:
        self.timed.append(j)
        if min(self.timed, key=Judged.key) is j:  # its memory over time is the verdict's count (one model per page)
            self.best_sim = sim if sim is None or not j.memory else with_job_memory(sim, j.memory)


def plan(request: PlanRequest, *, shapes_for: ShapesFor, build: Build | None = None, simulate: Simulate | None = None,
         progress: Progress | None = None, searcher: Searcher | None = None, started: float | None = None,
         page: bool = False, workers: int = 1) -> Plan:
    """Judge every candidate's memory before timing any (:func:`memory_order`: the shapes, the expensive part, once
    per group), then time those that fit in order of their lower bound (pruned by the bound with unit costs), then
    ``searcher``'s orders for the best few configurations, all within the time limit counted from ``started``
    (``time.monotonic()`` when the command began; default now), less a reserve for the output (``page``: an HTML
    page follows). The search has :data:`NAMED_SHARE`'s rest of the time only once every candidate is judged and
    every one that fits timed: while some are not, judging and timing them go on instead (an unjudged or untimed
    candidate may be the best; a searched order refines one already found). ``workers``: processes judging memory
    at once (:func:`_verdicts`; 1: this process alone). Ctrl-C keeps what was judged.

    Raises :class:`PlanError` when no candidate fits the cap, :class:`PlanStopped` when the time limit ran out
    before a candidate that fits was timed."""
    budget = Budget(started=time.monotonic() if started is None else started, limit_s=request.time_limit_s, page=page)
    compute = shapes_for.compute if isinstance(shapes_for, ShapeCache) else shapes_for
    judge = Judge(request, ShapeCache(budget.measured("shape", compute)), build or build_named,
                  budget.measured("time", simulate or Simulations().simulate))
    batch = global_batch(request.settings, request.num_gpus)
    ordered = memory_order(candidates(request, batch), request)
    # cannot run, known at once (microseconds each, whatever the order's size): judged first, time allowing
    refused = [judge.refusal(c) if budget.affords(0) else None for c in ordered]
    space = [j.candidate for j in refused if j is not None] + [c for c, j in zip(ordered, refused) if j is None]
    share = NAMED_SHARE if searcher is not None else 1.0
    found = _Found()
    found.judged += [j for j in refused if j is not None]
    found.memory_done = len(found.judged)
    verdicts = _verdicts(space, found.memory_done, judge, workers,
                         ahead=lambda: budget.affords(len(found.judged), "shape"))
    try:
        _judge_named(found, space, verdicts, judge, budget, share, progress)
        if found.memory_done < len(space) and share < 1.0:
            _judge_named(found, space, verdicts, judge, budget, 1.0, progress, first=False)
            if found.memory_done == len(space):
                _time_the_rest(found, judge, budget, progress)
        elif searcher is not None and found.timed:
            verdicts.close()  # every candidate judged: the workers are done
            _time_the_rest(found, judge, budget, progress)
            _search_orders(found, judge, searcher, budget, progress)
        found.stopped = found.stopped or _stopped(found, len(space), judge)
    except KeyboardInterrupt:
        found.stopped = (f"interrupted: memory of {found.memory_done} of {len(space)} candidates judged, "
                         f"{len(found.timed)} timed")
    finally:
        verdicts.close()  # the workers stop with it
    ranked = tuple(sorted(found.timed, key=Judged.key))
    result = Plan(request=request, global_batch=batch, judged=tuple(found.judged), ranked=ranked,
                  num_candidates=len(space), stopped=found.stopped, pruned=found.pruned,
                  memory_judged=found.memory_done, best_timeline=found.best_sim if ranked else None)
    if not ranked and not found.stopped.startswith("interrupted"):
        _refuse_empty(result, budget)
    return result


ORDER_TIERS = (20_000, 200_000)
"""Computations in a candidate's order (all ranks) that split the space into tiers judged one after the other:
judging one candidate's memory (and timing it) walks its whole order, about 10 us a computation, so a job of a
large global batch (thousands of microbatches at PP 32) judges its cheap candidates before its huge ones."""


def order_size(c: Candidate) -> int:
    """The forwards in the candidate's order, all ranks: what judging it costs (its backwards are as many)."""
    return c.degrees.pp * c.num_stages_per_rank * c.num_microbatches


def memory_order(space: Sequence[Candidate], request: PlanRequest) -> list[Candidate]:
    """The order memory is judged in: by tier of :func:`order_size` (:data:`ORDER_TIERS`: the cheap ones first),
    within a tier grouped by model shapes (the expensive call, once per group), the groups in order of their lowest
    lower bound, each group in lower-bound order. A group judged is cheap to judge whole, so every configuration of
    the first shapes (where one that fits often is) is judged before the next shapes are computed."""
    def tier(c: Candidate) -> int:
        return sum(order_size(c) > t for t in ORDER_TIERS)

    first: dict[tuple[int, tuple[int, int, str, int, int]], float] = {}
    for c in space:
        key = (tier(c), c.shape_key)
        first[key] = min(first.get(key, math.inf), lower_bound(c, request))
    return sorted(space, key=lambda c: (tier(c), first[(tier(c), c.shape_key)], c.shape_key, lower_bound(c, request),
                                        order_size(c)))


def _judge_named(found: _Found, space: Sequence[Candidate], verdicts: Iterator[tuple[Judged, Prepared | None]],
                 judge: Judge, budget: Budget, share: float, progress: Progress | None, *, first: bool = True) -> None:
    """The named orders, in rounds: memory in :func:`memory_order` (``verdicts``; the ``first`` round stops at
    :data:`MEMORY_SHARE` of the time once a candidate fits), then those that fit timed in lower-bound order; again
    with the candidates left while the time's ``share`` lasts. Forked workers judging memory go on while this
    process times."""
    while found.memory_done < len(space):
        before = found.memory_done
        ready = _judge_memory(found, space, verdicts, judge, budget, share, progress, leave_for_timing=first)
        _time_fitting(found, ready, judge, budget, share, progress)
        first = False
        if found.memory_done == before or not budget.affords(len(found.judged), share=share):
            break


def _stopped(found: _Found, total: int, judge: Judge) -> str:
    """Why the plan stopped short ("" when every candidate was judged and every one that fits timed or pruned)."""
    if found.memory_done < total or any(j.reason == TIME_RAN_OUT for j in found.judged):
        fit = sum(j.fits for j in found.judged)
        return (f"time limit ({judge.request.time_limit_s:g} s): memory of {found.memory_done} of {total} "
                f"candidates judged ({fit} fit), {len(found.timed)} of those timed")
    return ""


def _judge_memory(found: _Found, space: Sequence[Candidate], verdicts: Iterator[tuple[Judged, Prepared | None]],
                  judge: Judge, budget: Budget, share: float, progress: Progress | None, *,
                  leave_for_timing: bool) -> dict[int, Prepared]:
    """The next candidates' memory (``verdicts``, :func:`_verdicts` of ``space`` in :func:`memory_order`), while
    the time's ``share`` lasts (none once it is up); ``leave_for_timing``: once one fits, stop at
    :data:`MEMORY_SHARE` of it. What timing needs, by index, for those that fit."""
    ready: dict[int, Prepared] = {}
    for i in range(found.memory_done, len(space)):
        new_shape = isinstance(judge.shapes_for, ShapeCache) and not judge.shapes_for.has(space[i].shape_key)
        fraction = MEMORY_SHARE if ready and leave_for_timing else 1.0
        if not budget.affords(i, "shape" if new_shape else None, share=share * fraction):
            break
        j, prepared = next(verdicts)
        found.judged.append(j)
        found.memory_done = i + 1
        if prepared is not None:
            ready[i] = prepared
        _report(progress, "memory", i + 1, len(space), sum(j.fits for j in found.judged), None, budget)
    return ready


FORKED_AT_LEAST = 4
"""A run of candidates sharing their shapes is judged by forked workers from this many on (fewer: in this process;
starting workers costs about what one small candidate's judging does)."""


def _verdicts(space: Sequence[Candidate], start: int, judge: Judge, workers: int,
              ahead: Callable[[], bool] = lambda: True) -> Generator[tuple[Judged, Prepared | None], None, None]:
    """``judge.memory`` of ``space[start:]``, in order. With ``workers`` > 1, each run of candidates sharing their
    shapes (:func:`memory_order` keeps them together) is judged by workers forked once its shapes are made here, so
    they inherit them (:class:`ppsim.workers.ForkedMap`); the next run's workers start with this run's, so no core
    waits on one slow candidate and the workers go on while the caller times what fits; ``ahead()`` says whether the
    time left affords making the next run's shapes before they are asked for. What timing needs of one that fits is
    rebuilt here."""
    from ppsim.workers import ForkedMap, can_fork

    runs = _shape_runs(space, start)
    if workers <= 1 or not can_fork():
        for i, end in runs:
            for k in range(i, end):
                yield judge.memory(space[k])
        return

    pools: dict[int, ForkedMap | None] = {}

    def launch(r: int) -> None:  # run r's workers, unless started, or too few candidates (judged here)
        if r >= len(runs) or r in pools:
            return
        i, end = runs[r]
        pools[r] = None
        if end - i < FORKED_AT_LEAST:
            return
        try:
            shapes_of(judge.shapes_for, space[i])  # here, once: the forked workers inherit them
        except PPSimError:
            pass  # each candidate says so when judged
        pools[r] = ForkedMap(functools.partial(_memory_verdict, judge), space[i:end], workers)

    try:
        for r, (i, end) in enumerate(runs):
            launch(r)
            if ahead():
                launch(r + 1)
            pool = pools[r]
            if pool is None:
                for k in range(i, end):
                    yield judge.memory(space[k])
                continue
            for j in pool:
                yield j, (judge.prepared(j.candidate) if j.fits else None)
            pool.close()
            del pools[r]
    finally:
        for pool in pools.values():
            if pool is not None:
                pool.close()


def _shape_runs(space: Sequence[Candidate], start: int) -> list[tuple[int, int]]:
    """``space[start:]`` cut into runs of consecutive candidates sharing their shapes, as ``(first, end)``."""
    runs, i = [], start
    while i < len(space):
        end = i + 1
        while end < len(space) and space[end].shape_key == space[i].shape_key:
            end += 1
        runs.append((i, end))
        i = end
    return runs


def _memory_verdict(judge: Judge, c: Candidate) -> Judged:
    """A worker's verdict on ``c``, without the allocator's per-event trace (only its peaks cross back)."""
    j, _ = judge.memory(c)
    return dataclasses.replace(j, memory=tuple(m if m.reserved is None else dataclasses.replace(
        m, reserved=dataclasses.replace(m.reserved, trace=dataclasses.replace(m.reserved.trace, reserved=(),
                                                                              allocated=())))
        for m in j.memory))


def _time_fitting(found: _Found, ready: dict[int, Prepared], judge: Judge, budget: Budget, share: float,
                  progress: Progress | None) -> None:
    """Time the candidates that fit, in lower-bound order; with unit costs, stop once the bound reaches the K-th
    best step (no later candidate can enter the top K)."""
    request = judge.request
    order = sorted(ready, key=lambda i: lower_bound(found.judged[i].candidate, request))
    for n, i in enumerate(order):
        kth = _kth_unit(found.timed, request.top)
        if kth is not None and not request.profiles and lower_bound(found.judged[i].candidate, request) >= kth:
            found.pruned += len(order) - n
            _not_timed(found, order[n:], f"its lower bound cannot enter the top {request.top}")
            break
        if not budget.affords(len(found.judged), "time", share=share):
            _not_timed(found, order[n:], "the time limit ran out")
            break
        found.judged[i], sim = judge.time(found.judged[i], ready.pop(i))
        if sim is not None:
            found.add_timed(found.judged[i], sim)
        _report(progress, "timing", n + 1, len(order), len(order), min(found.timed, key=Judged.key, default=None),
                budget)


TIME_RAN_OUT = "not timed: the time limit ran out"


def _time_the_rest(found: _Found, judge: Judge, budget: Budget, progress: Progress | None) -> None:
    """Once every candidate's memory is judged, the ones that fit but the named orders' share of the time left
    untimed, timed before the order search takes the rest (an untimed one may be the fastest; a searched order only
    refines one already timed), in lower-bound order, while the whole limit lasts."""
    request = judge.request
    ready: dict[int, Prepared] = {}
    for i in sorted((i for i, j in enumerate(found.judged) if j.reason == TIME_RAN_OUT),
                    key=lambda i: lower_bound(found.judged[i].candidate, request)):
        if not budget.affords(len(found.judged), "time"):
            break
        ready[i] = judge.prepared(found.judged[i].candidate)
        found.judged[i] = dataclasses.replace(found.judged[i], reason="")
    _time_fitting(found, ready, judge, budget, 1.0, progress)


def _not_timed(found: _Found, indices: Sequence[int], why: str) -> None:
    for k in indices:
        found.judged[k] = dataclasses.replace(found.judged[k], reason=f"not timed: {why}")


def _report(progress: Progress | None, phase: str, done: int, total: int, fitting: int, best: Judged | None,
            budget: Budget) -> None:
    if progress is not None:
        progress(PlanProgress(phase=phase, done=done, total=total, fitting=fitting, best=best,
                              elapsed_s=budget.elapsed_s()))


def _search_orders(found: _Found, judge: Judge, searcher: Searcher, budget: Budget, progress: Progress | None) -> None:
    """``searcher``'s orders for the best few configurations, in what is left of the limit."""
    left = lambda: budget.left_s(len(found.judged))  # noqa: E731
    for j, sim in searched(found.timed, judge, searcher=searcher, seconds_left=left):
        found.judged.append(j)
        found.add_timed(j, sim)
        _report(progress, "orders", len(found.judged), len(found.judged), len(found.timed), j, budget)


def searched(timed: Sequence[Judged], judge: Judge, *, searcher: Searcher,
             seconds_left: Callable[[], float]) -> list[tuple[Judged, Any]]:
    """``search``'s order for the best few configurations (distinct degrees, microbatches and stage counts),
    judged the same way; only an order that fits and beats its named schedule is kept, with its simulated step.
    Each search gets :data:`SEARCH_SHARE` of its part of the time left (the rest: simulating and judging around
    it)."""
    request = judge.request
    seen: set[tuple[Any, ...]] = set()
    out: list[tuple[Judged, Any]] = []
    for j in sorted(timed, key=Judged.key):
        c = j.candidate
        config = (c.degrees, c.microbatch_size, c.num_stages_per_rank, c.activation_checkpoint, c.schedule in V_SHAPE)
        left = seconds_left()
        if c.degrees.pp == 1:  # no pipeline: no order to search
            continue
        if config in seen or len(seen) >= NUM_SEARCHED or left <= 0:
            continue
        seen.add(config)
        named = judge.build(c.schedule, c.degrees.pp, c.num_microbatches, c.num_stages_per_rank)
        cover = covering_profile(c, request)
        unit = unit_costs(c, request, shapes_of(judge.shapes_for, c)).text()
        found = searcher(named, job_of(c, request), cover, unit,
                         SEARCH_SHARE * left / (NUM_SEARCHED - len(seen) + 1), c)
        if found is None:
            continue
        order, csv = found
        k, sim = judge(dataclasses.replace(c, csv=csv), order=order)
        if sim is not None and k.fits and k.key() < j.key():
            out.append((k, sim))
    return out


def _kth_unit(timed: Sequence[Judged], k: int) -> float | None:
    steps = sorted(j.relative_step for j in timed if j.relative_step is not None)
    return steps[k - 1] if len(steps) >= k else None


def _refuse_empty(result: Plan, budget: Budget) -> None:
    """No candidate ranked: the time limit's doing (:class:`PlanStopped`), no candidate could run or be timed, or
    truly none fits the cap (:class:`PlanError`, naming the smallest peak)."""
    fitting = [j for j in result.judged if j.fits]
    limit = result.request.time_limit_s
    more = f"raise --time-limit (e.g. --time-limit {max(2 * limit, math.ceil(budget.elapsed_s() * 2)):g})"
    if fitting and any(j.reason == TIME_RAN_OUT for j in fitting):
        raise PlanStopped(f"--time-limit {limit:g}: ran out after {budget.elapsed_s():.1f} s, having judged the memory "
                          f"of {result.memory_judged} of {result.num_candidates} candidates ({len(fitting)} fit, none "
                          "timed yet): the limit, not "
                          f"the memory cap, stopped the plan; {more}")
    if fitting:
        reasons = sorted({j.reason for j in fitting})
        raise PlanError(f"{len(fitting)} candidates fit but none could be timed ({'; '.join(reasons)[:300]}); "
                        "check --profile or change the job")
    if result.memory_judged == 0:
        raise PlanStopped(f"--time-limit {limit:g}: ran out after {budget.elapsed_s():.1f} s, before any candidate "
                          "was judged (start-up and reading the job took that long): the limit, not the memory cap, "
                          f"stopped the plan; {more}")
    if result.memory_judged < result.num_candidates:
        smallest = min((j for j in result.judged if j.memory), key=lambda j: j.peak_bytes, default=None)
        peak = (f" (the smallest peak so far is {smallest.peak_bytes / GIB:.2f} GiB, {describe(smallest.candidate)})"
                if smallest is not None else "")
        raise PlanStopped(f"--time-limit {limit:g}: ran out after {budget.elapsed_s():.1f} s, having judged the memory "
                          f"of {result.memory_judged} of {result.num_candidates} candidates, none of which fits{peak}; "
                          f"the limit, not the memory cap, stopped the plan before the rest were judged; {more}")
    raise PlanError(nothing_fits(result))
