"""What every figure draws, read from a :class:`~ppsim.result.SimResult`: cells, idle gaps, colours, legend texts.

Plain Python on purpose (no matplotlib, plotly or pandas here): the static Gantt, the interactive one and the
report all draw the same cells with the same colours and words, so those live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppsim.ir import ActionType

if TYPE_CHECKING:
    from ppsim.result import SimResult

#: Fill colours sampled from DeepSeek's DualPipe figures.
COLORS = {"F": "#F1B238", "B": "#7FD650", "I": "#7FD650", "W": "#77BEFA"}
IDLE_EDGE = "#A6A6A6"
DIGIT_COLORS = ("#000000", "#FFFFFF")

#: Cell groups in drawing and legend order. A pair's halves are their own groups (drawn without a border of
#: their own; one border goes around the pair).
GROUPS = ("F", "B", "I", "W", "pair-F", "pair-B")
GROUP_KIND = {"F": "F", "B": "B", "I": "I", "W": "W", "pair-F": "F", "pair-B": "B"}
LEGEND_LABELS = {
    "F": "Forward",
    "B": "Backward",
    "I": "Backward for input",
    "W": "Backward for weights",
    "pair": "Overlapped forward & backward",
}
PAIR_LABEL = LEGEND_LABELS["pair"]
RECOMPUTE_LABEL = "Recomputes its forward first"
"""Legend text of the hatch on a backward whose (stage, microbatch) is recomputed."""
RECOMPUTE_HATCH = "////"
RECOMPUTE_HATCH_COLOR = "#333333"


@dataclass(frozen=True, slots=True)
class Cell:
    """One drawn rectangle: a single computation, or one half of an overlapped pair.

    ``start``/``end`` are where it is drawn (a pair's forward half first, in its cost share);
    ``action_start``/``action_end`` are the whole action's times. ``shade`` 1 means white digits (second chunk, or
    DualPipe's reverse direction), 0 black.
    """

    rank: int
    position: int
    group: str
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    action_start: float
    action_end: float
    action: str
    shade: int
    recomputed: bool = False
    """A backward (B, I or a pair's backward half) that runs its (stage, microbatch)'s forward again first."""

    @property
    def pair(self) -> bool:
        return self.group.startswith("pair-")


@dataclass(frozen=True)
class DigitKey:
    """How digit colour tells stages apart on a rank, and the legend words for black and white digits."""

    by: str | None  # "direction", "chunk", or None when every cell gets black digits
    black: str = ""
    white: str = ""


def digit_key(result: SimResult) -> DigitKey:
    s = result.schedule
    if len(s.pipelines) > 1:
        return DigitKey("direction", "Microbatch, forward direction", "Microbatch, reverse direction")
    if s.num_stages_per_rank == 2:
        return DigitKey("chunk", "Microbatch, 1st chunk", "Microbatch, 2nd chunk")
    if s.num_stages_per_rank > 2:
        return DigitKey("chunk", "Microbatch, even chunk (0, 2, …)", "Microbatch, odd chunk (1, 3, …)")
    return DigitKey(None)


def _shades(result: SimResult, key: DigitKey) -> list[int]:
    s = result.schedule
    shade = [0] * s.num_stages
    if key.by == "direction":
        for d, chain in enumerate(s.pipelines):
            for stage in chain:
                shade[stage] = 1 if d % 2 else 0
    elif key.by == "chunk":
        for rank in range(s.num_ranks):
            for c, stage in enumerate(s.stages_of(rank)):
                shade[stage] = c % 2
    return shade


def cells(result: SimResult) -> list[Cell]:
    """Every drawn cell, rank by rank in execution order (a pair gives its forward half, then its backward half)."""
    s = result.schedule
    shade = _shades(result, digit_key(result))
    # where each pair's forward half ends, as the simulator recorded it (pairs in rank / position order)
    pair_mids = iter(result.trace.pair_mid.tolist())
    rc = result.recompute
    out: list[Cell] = []
    for rank, row in enumerate(s.actions):
        starts, ends = result.starts[rank], result.ends[rank]
        for pos, action in enumerate(row):
            t0, t1 = starts[pos], ends[pos]
            if action.type is ActionType.OVERLAP_F_B:
                f, b = action.sub_actions
                mid = next(pair_mids)
                text = str(action)
                out.append(Cell(rank, pos, "pair-F", "F", f.stage, f.microbatch or 0, t0, mid, t0, t1, text,
                                shade[f.stage]))
                out.append(Cell(rank, pos, "pair-B", b.type.value, b.stage, b.microbatch or 0, mid, t1, t0, t1,
                                text, shade[b.stage], (b.stage, b.microbatch) in rc))
            elif action.type.value in COLORS:
                kind = action.type.value
                out.append(Cell(rank, pos, kind, kind, action.stage, action.microbatch or 0, t0, t1, t0, t1,
                                str(action), shade[action.stage],
                                kind in ("B", "I") and (action.stage, action.microbatch) in rc))
    return out


def pair_borders(result: SimResult) -> list[tuple[int, float, float]]:
    """``(rank, start, end)`` of every overlapped pair (one shared border around both halves)."""
    s = result.schedule
    return [
        (rank, result.starts[rank][pos], result.ends[rank][pos])
        for rank, row in enumerate(s.actions)
        for pos, action in enumerate(row)
        if action.type is ActionType.OVERLAP_F_B
    ]


def idle_gaps(result: SimResult) -> list[tuple[int, float, float]]:
    """``(rank, start, end)`` of every stretch in ``[0, makespan]`` where a rank computes nothing."""
    eps = 1e-9 * max(result.makespan, 1e-300)
    gaps: list[tuple[int, float, float]] = []
    for rank in range(result.schedule.num_ranks):
        spans = sorted(zip(result.starts[rank], result.ends[rank]))
        t = 0.0
        for a, b in spans:
            if a - t > eps:
                gaps.append((rank, t, a))
            t = max(t, b)
        if result.makespan - t > eps:
            gaps.append((rank, t, result.makespan))
    return gaps


@dataclass(frozen=True)
class TimeScale:
    """Axis unit: tick value = time * factor."""

    factor: float
    label: str
    suffix: str


def time_scale(result: SimResult, *, span: float | None = None) -> TimeScale:
    span = result.makespan if span is None else span
    if result.unit != "s":
        return TimeScale(1.0, "Time (cost units)", " units")
    if span < 1e-3:
        return TimeScale(1e6, "Time (µs)", " µs")
    if span < 1.0:
        return TimeScale(1e3, "Time (ms)", " ms")
    return TimeScale(1.0, "Time (s)", " s")


def suffix_for(result: SimResult, factor: float) -> str:
    """The unit suffix (" units", " ms", ...) that goes with a tick factor."""
    if result.unit != "s":
        return " units"
    return {1e6: " µs", 1e3: " ms"}.get(factor, " s")


def fmt_time(result: SimResult, value: float) -> str:
    ts = time_scale(result)
    return f"{value * ts.factor:.4g}{ts.suffix}"


def title(result: SimResult) -> str:
    s = result.schedule
    return (
        f"{s.name}: {s.num_ranks} ranks, {s.num_microbatches} microbatches, "
        f"makespan {fmt_time(result, result.makespan)}, bubble {result.bubble_ratio:.1%}" + recompute_note(result)
    )


def recompute_note(result: SimResult) -> str:
    """``", recomputing 12 of 32 activations"`` when the result recomputes some, else ``""``."""
    if not result.recompute:
        return ""
    total = result.schedule.num_microbatches * result.schedule.num_stages
    return f", recomputing {len(result.recompute)} of {total} activations"
