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
        + comm_note(result)
    )


def comm_note(result: SimResult) -> str:
    """``", all-to-all 56 of 100 units exposed"`` per kind of collective in the step (its lane), else ``""``."""
    ts = time_scale(result)
    return "".join(f", {COLLECTIVE_WORDS.get(kind, kind)} {t.exposed_s * ts.factor:.4g} of "
                   f"{t.total_s * ts.factor:.4g}{ts.suffix} exposed"
                   for kind, t in (result.collectives or {}).items() if t.count)


def recompute_note(result: SimResult) -> str:
    """``", recomputing 12 of 32 activations"`` when the result recomputes some, else ``""``."""
    if not result.recompute:
        return ""
    total = result.schedule.num_microbatches * result.schedule.num_stages
    return f", recomputing {len(result.recompute)} of {total} activations"


#: The communication lane's two parts: the collectives' time a compute waited on (added to its action), strong, and
#: the time that ran hidden behind compute, light (DeepSeek's figure 4 puts communication under the computation).
COMM_PARTS = ("hidden", "exposed")
COMM_COLORS = {"hidden": "#C39BD3", "exposed": "#6A1B9A"}
COMM_LABELS = {"exposed": "Communication, exposed", "hidden": "Communication, hidden"}
#: collectives whose group spans several nodes (over the network) are hatched in the lane
ACROSS_HATCH = "////"
ACROSS_LABEL = "Across nodes (hatched)"
COMM_LANE_COLOR = "#F2F2F2"
"""The lane's track (where a rank's actions hold no collectives)."""
COLLECTIVE_WORDS = {"all_to_all": "all-to-all", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


@dataclass(frozen=True)
class RowLayout:
    """Where a rank's row draws its parts, as offsets from the rank's index (rows one unit apart, y grows down).

    Without collectives the compute cells fill the row (``(-0.5, 0.5)``, rows touching as in the DualPipe figures);
    with them a thin communication lane sits under the cells, and a figure makes its rows :attr:`height_scale`
    times as tall so the cells keep their height.
    """

    compute: tuple[float, float] = (-0.5, 0.5)
    lane: tuple[float, float] | None = None

    @property
    def centre(self) -> float:
        """The compute cells' centre: where digits, row labels and p2p arrows go."""
        return (self.compute[0] + self.compute[1]) / 2

    @property
    def height_scale(self) -> float:
        return 1.0 / (self.compute[1] - self.compute[0])


PLAIN_ROWS = RowLayout()
LANE_ROWS = RowLayout(compute=(-0.5, 0.22), lane=(0.25, 0.41))


def row_layout(result: SimResult) -> RowLayout:
    return LANE_ROWS if result.comm_spans else PLAIN_ROWS


@dataclass(frozen=True, slots=True)
class LaneSpan:
    """One drawn strip of the communication lane: the ``part`` (``"hidden"`` or ``"exposed"``) of the collectives of
    the action at (``rank``, ``position``), drawn from ``start`` to ``end``; ``total`` and ``exposed`` are the
    action's whole :class:`~ppsim.result.CommSpan` (both strips of an action carry the same)."""

    rank: int
    position: int
    part: str
    start: float
    end: float
    total: float
    exposed: float
    kinds: tuple[str, ...]
    action: str
    across: bool = False
    """Some of the action's collectives cross nodes (drawn hatched)."""

    @property
    def kind_words(self) -> str:
        words = " + ".join(COLLECTIVE_WORDS.get(k, k) for k in self.kinds) or "collectives"
        return words + (" (across nodes)" if self.across else "")


def comm_lane(result: SimResult) -> list[LaneSpan]:
    """The communication lane's strips from ``result.comm_spans``, rank by rank in execution order, hidden before
    exposed: the exposed part at the action's end (the time added to it, the compute waiting), the hidden part from
    its start (it ran under the action's compute: in an overlapped pair, one direction's all-to-alls under the other's
    compute). The lane shows how much of an action is communication and how much of that was exposed, not each
    exchange's own start."""
    if not result.comm_spans:
        return []
    out: list[LaneSpan] = []
    for rank, pos in sorted(result.comm_spans):
        span = result.comm_spans[(rank, pos)]
        s, e = result.starts[rank][pos], result.ends[rank][pos]
        action = str(result.schedule.actions[rank][pos])
        hidden = min(span.total - span.exposed, max(0.0, e - span.exposed - s))
        if hidden > 0:
            out.append(LaneSpan(rank, pos, "hidden", s, s + hidden, span.total, span.exposed, span.kinds, action,
                                span.across))
        if span.exposed > 0:
            out.append(LaneSpan(rank, pos, "exposed", max(s, e - span.exposed), e, span.total, span.exposed,
                                span.kinds, action, span.across))
    return out
