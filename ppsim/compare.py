"""Comparing schedules: build several, skip (with the reason) those that cannot run, simulate, rank by makespan.

The comparability rule lives here. ``--costs`` times are per stage chunk by default (as in the DualPipe figures), so
schedules that cut the model into different numbers of stages (1F1B: R, Interleaved1F1B and DualPipeV: 2R) would
describe different models. Unless the caller names a scope, such a comparison reads the costs as one rank's share of
one model copy (``scope="rank"``), which ranks the schedules on the same model; an explicit ``"stage"`` is honoured
with a warning. A profile is measured per stage and is used as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ppsim.errors import CostError, PPSimError

if TYPE_CHECKING:
    from ppsim.costs import CostSpec, StageCosts
    from ppsim.io import MemoryCap
    from ppsim.ir import Schedule
    from ppsim.result import SimResult
    from ppsim.step.model import Step


class CostScope(str, Enum):
    """What ``--costs`` times describe: one stage chunk, or one rank's share of one model copy."""

    stage = "stage"
    rank = "rank"


class NothingToCompareError(PPSimError):
    """None of the requested schedules can run the configuration."""


@dataclass(frozen=True)
class Skipped:
    """A requested schedule that cannot run the configuration, and why (the one-line error)."""

    name: str
    reason: str


@dataclass(frozen=True)
class Comparison:
    """Simulated schedules, fastest first, the ones skipped, and the cost scope they were compared at."""

    results: tuple[SimResult, ...]
    skipped: tuple[Skipped, ...]
    costs: CostSpec
    scope: CostScope
    scope_reason: str
    """Why this scope: ``"default"``, ``"given"``, ``"same stage count"``, ``"profile"``, or the stage counts."""
    notes: tuple[str, ...] = ()
    """Warnings for the user (one line each): options a schedule ignores, an unfair comparison asked for."""

    @property
    def best(self) -> SimResult:
        return self.results[0]

    @property
    def scope_text(self) -> str:
        """One line for people: which scope was used and why."""
        if not self.costs.is_uniform:
            return "costs from the profile (measured or composed per stage)"
        what = {CostScope.stage: "per stage chunk", CostScope.rank: "per rank share of one model copy"}[self.scope]
        return f"cost scope: {self.scope.value} (--costs times {what}; {self.scope_reason})"

    def entries(self) -> list[tuple[str, SimResult | str]]:
        """``(name, result)`` fastest first, then ``(name, reason)`` for each schedule skipped."""
        return [(r.schedule.name, r) for r in self.results] + [(s.name, s.reason) for s in self.skipped]


def rank(results: Iterable[SimResult]) -> list[SimResult]:
    """Results fastest first (by makespan; ties keep their order)."""
    return sorted(results, key=lambda r: r.makespan)


def build(
    name_or_path: str,
    num_ranks: int | None,
    num_microbatches: int | None,
    num_stages_per_rank: int | None = None,
    *,
    num_pipelines: int | None = None,
    allow_large: bool = False,
    figure: bool = False,
    check: bool = True,
) -> tuple[Schedule, list[str]]:
    """A schedule by name or CSV file, and a warning for each given option it ignores.

    ``num_pipelines`` (``--directions``) is read from CSV files only; ``num_stages_per_rank`` (``-v``) must match
    a CSV file's placement. Loading goes through :func:`ppsim.schedules.loading.load` (work bounded, ``figure``
    for the stricter figure limits; a file's sizes read from it and the file validated).
    """
    from ppsim.schedules.loading import load

    is_file = name_or_path.lower().endswith(".csv")
    notes: list[str] = []
    if not is_file and num_pipelines not in (None, 1):
        notes.append(f"warning: --directions {num_pipelines} applies to .csv files only; {name_or_path} builds its "
                     "own pipelines, so it is ignored")
    loaded = load(
        name_or_path, num_ranks=num_ranks, num_microbatches=num_microbatches,
        num_stages_per_rank=None if is_file else num_stages_per_rank,
        num_pipelines=(num_pipelines or 1) if is_file else 1, allow_large=allow_large, figure=figure, check=check,
    )
    schedule = loaded.schedule
    notes.extend(f"note: {note}" for note in loaded.notes)
    if is_file and num_stages_per_rank is not None and num_stages_per_rank != schedule.num_stages_per_rank:
        raise PPSimError(
            f"--stages-per-rank {num_stages_per_rank}: {name_or_path} places {schedule.num_stages_per_rank} "
            f"stage(s) per rank; drop -v (a file fixes its own placement) or pass -v {schedule.num_stages_per_rank}"
        )
    return schedule, notes


def resolve_scope(
    schedules: Sequence[Schedule], costs: CostSpec, scope: CostScope | str | None
) -> tuple[CostScope, str, list[str]]:
    """The scope to simulate ``schedules`` at, why, and warnings (see the module docstring for the rule)."""
    counts = [(s.name, len(s.pipelines[0])) for s in schedules]
    differ = len({n for _, n in counts}) > 1
    detail = ", ".join(f"{name}: {n}" for name, n in counts)
    if scope is not None:
        chosen = CostScope(scope)
        if not costs.is_uniform:  # a profile: its costs are per stage already, the scope would change nothing
            raise CostError(f"--cost-scope {chosen.value} applies to --costs; a profile's costs are measured per stage "
                            "(its blocks compose each schedule's stages), drop --cost-scope")
        notes = []
        if chosen is CostScope.stage and differ and costs.is_uniform:
            notes.append(
                f"warning: --cost-scope stage: these schedules cut the model into different numbers of stages "
                f"({detail}) and every chunk costs the same, so the chunks differ in size and the schedules "
                "describe different models; drop --cost-scope to compare them on the same model"
            )
        return chosen, "given", notes
    if not costs.is_uniform:
        return CostScope.stage, "profile", []
    if differ:
        return CostScope.rank, f"the schedules cut the model into different numbers of stages ({detail}), so they " \
                               "are compared on the same model; pass --cost-scope stage to time each chunk as given", []
    return CostScope.stage, "default", []


def compare(
    names: Sequence[str],
    *,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    num_stages_per_rank: int | None = None,
    num_pipelines: int | None = None,
    costs: CostSpec | StageCosts | None = None,
    scope: CostScope | str | None = None,
    memory_cap_bytes: int | None = None,
    memory_cap: MemoryCap | None = None,
    builder: Callable[[str], Schedule] | None = None,
    figure: bool = False,
    allow_large: bool = False,
    recompute: Callable[[str, Schedule], Set[tuple[int, int]]] | None = None,
    step: Callable[[Schedule, StageCosts], Step] | None = None,
) -> Comparison:
    """Build each schedule in ``names``, skip those that cannot run or whose costs do not fit them (a ``--split`` of
    another chain length; reasons kept), simulate the rest, rank them.

    A single name that cannot be built raises its error; when none of several can, raises
    :class:`NothingToCompareError` listing why. ``scope=None`` applies the comparability rule (module docstring).
    ``builder`` replaces :func:`build` (and the ranks/microbatches/stages/pipelines arguments): it builds one
    schedule from a name, raising :class:`PPSimError` for one that cannot run; the CLI passes its own loader.
    A name given twice (any case) is compared once. The schedules together are bounded
    (:data:`~ppsim.limits.MAX_COMPARE_ACTIONS`; with ``figure``, the report's limits) unless ``allow_large``.
    ``recompute(name, schedule)`` gives each built schedule's recomputed (stage, microbatch) pairs
    (:mod:`ppsim.recompute`); its errors are the schedule's, as for building. ``step(schedule, costs)``: the schedule
    as the one step model times it (:func:`ppsim.step.build.build_step`: every dimension's communication in it),
    simulated in its place.
    """
    from ppsim import limits
    from ppsim.costs import as_spec
    from ppsim.simulator import simulate

    if not names:
        raise PPSimError("--schedule: give at least one schedule name, e.g. -s DualPipeV")
    cost_model = as_spec(costs)
    built: list[Schedule] = []
    recomputed: list[Set[tuple[int, int]]] = []
    skipped: list[Skipped] = []
    notes: list[str] = []
    unique: dict[str, str] = {}  # schedule names are case-insensitive, file paths are not
    for name in names:
        unique.setdefault(name if name.lower().endswith(".csv") else name.lower(), name)
    if len(unique) < len(names):
        notes.append(f"note: {', '.join(names)}: a schedule given more than once is compared once")
        names = list(unique.values())
    total_actions = total_rows = 0
    for name in names:
        try:
            if builder is None:
                schedule, ignored = build(name, num_ranks, num_microbatches, num_stages_per_rank,
                                          num_pipelines=num_pipelines)
            else:
                schedule, ignored = builder(name), []
            chosen_rc = recompute(name, schedule) if recompute is not None else frozenset()
        except PPSimError as exc:
            if len(names) == 1:
                raise
            skipped.append(Skipped(name, str(exc)))
            continue
        built.append(schedule)
        recomputed.append(chosen_rc)
        notes.extend(n for n in ignored if n not in notes)
        total_actions += sum(map(len, schedule.actions))
        total_rows += schedule.num_ranks
        if len(names) > 1:
            limits.check_total(
                "these schedules" if not figure else "this report", total_rows, total_actions,
                max_actions=limits.MAX_REPORT_ACTIONS if figure else limits.MAX_COMPARE_ACTIONS,
                max_ranks=limits.MAX_REPORT_RANKS if figure else None, allow_large=allow_large,
            )
    if not built:
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped)
        raise NothingToCompareError(
            f"--schedule {','.join(names)!r}: none of these schedules can run this configuration ({reasons})"
        )
    chosen, reason, scope_notes = resolve_scope(built, cost_model, scope)
    results = []
    for schedule, rc in zip(built, recomputed):
        try:  # costs that do not fit this schedule (a --split of another length): skip it, keep the others
            costs = cost_model.for_schedule(schedule, scope=chosen.value)
            timed = None if step is None else step(schedule, costs)
            if timed is not None:
                notes.extend(n for n in timed.notes if n not in notes)
                costs = timed.costs if timed.costs is not None else costs
            target = schedule if timed is None else timed.schedule

            def simulate_with(extra: Any, target: Schedule = target, costs: Any = costs, rc: Any = rc) -> Any:
                return simulate(target, costs, memory_cap_bytes=memory_cap_bytes, memory_cap=memory_cap,
                                recompute=rc, extra_s=extra)

            results.append(simulate_with(None) if timed is None else timed.simulate(simulate_with))
        except PPSimError as exc:
            if len(names) == 1:
                raise
            skipped.append(Skipped(schedule.name, str(exc)))
    if not results:
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped)
        raise NothingToCompareError(
            f"--schedule {','.join(names)!r}: none of these schedules can run this configuration ({reasons})"
        )
    return Comparison(
        results=tuple(rank(results)),
        skipped=tuple(skipped),
        costs=cost_model,
        scope=chosen,
        scope_reason=reason,
        notes=tuple(notes + scope_notes),
    )
