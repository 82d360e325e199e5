"""The search's public value types (cap, named result, progress, result) and the helpers every phase shares."""

from __future__ import annotations

from dataclasses import dataclass

from ppsim.costs import StageCosts
from ppsim.errors import PPSimError
from ppsim.io import MemoryCap
from ppsim.io import parse_memory_cap as parse
from ppsim.ir import Schedule
from ppsim.result import SimResult
from ppsim.schedules._phases import v_placement
from ppsim.search.choices import SEARCH_NAME, Placement, Solver
from ppsim.search.listsched import Problem, make_problem


class MemoryCapError(PPSimError):
    """A memory cap is malformed, needs a profile, or is too small for any order."""


def parse_memory_cap(text: str | int | float | MemoryCap) -> MemoryCap:
    """``"8act"`` or a byte size (``80GiB``, ``1.5e9``), as :func:`ppsim.io.parse_memory_cap` reads them; a number
    is bytes."""
    if isinstance(text, MemoryCap):
        return text
    if isinstance(text, (int, float)):
        if text <= 0:
            raise MemoryCapError(f"--memory-cap {text}: must be positive; e.g. 80GiB or 8act")
        return MemoryCap(float(int(text)), "bytes")
    cap = parse(text)
    assert cap is not None
    return cap


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
    optimal: bool = False
    """The makespan meets the lower bound: no order is faster (proven by CP-SAT or by the analytic bound)."""
    bound_source: str = "analytic"
    """What proved ``lower_bound``: ``"analytic"`` (:func:`ppsim.search.lower_bound`) or ``"CP-SAT"``."""

    @property
    def gap(self) -> float:
        """Relative distance to the lower bound (0.05 = 5 % above it)."""
        if self.lower_bound <= 0:
            return 0.0
        gap = self.makespan / self.lower_bound - 1.0
        return 0.0 if abs(gap) <= 1e-9 else gap

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
            "optimal": self.optimal,
            "bound_source": self.bound_source,
            "source": self.source,
            "num_stages_per_rank": self.schedule.num_stages_per_rank,
            "placement": "v" if is_v(self.schedule) else "loop",
            "best_named": None if best is None else best.name,
            "named": [n.__dict__ for n in self.named],
            "evaluations": self.evaluations,
            "elapsed_s": self.elapsed_s,
            "stopped": self.stopped,
            "seed": self.seed,
            "cost_scope": self.cost_scope,
            "csv": self.schedule.to_rows(),
        }


def is_v(schedule: Schedule) -> bool:
    return schedule.num_stages == 2 * schedule.num_ranks and schedule.stage_to_rank == v_placement(schedule.num_ranks)


def peak_of(sim: SimResult, unit: str) -> float:
    """The largest per-rank peak, in activations or bytes."""
    if unit == "bytes":
        return float(max((p.peak_memory_bytes or 0) for p in sim.per_rank))
    return float(max(p.peak_activations for p in sim.per_rank))


def fits(sim: SimResult, cap: MemoryCap) -> bool:
    return peak_of(sim, cap.unit) <= cap.amount + 1e-9


def problem_for(template: Schedule, costs: StageCosts, cap: MemoryCap) -> Problem:
    return make_problem(template, costs, cap.amount, unit=cap.unit)


__all__ = ["SEARCH_NAME", "MemoryCap", "MemoryCapError", "NamedResult", "Placement", "Progress", "SearchResult",
           "Solver", "fits", "is_v", "parse_memory_cap", "peak_of", "problem_for"]
