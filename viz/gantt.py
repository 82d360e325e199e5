"""Static Gantt charts in the look of DeepSeek's DualPipe figures (matplotlib, no pyplot).

Every function takes a simulation result and an optional ``ax`` and returns the figure; none calls ``show()``.
Rows are ranks ("Device r"), time runs right, each cell is as wide as its simulated duration, idle time is blank.
Cells are drawn as one :class:`~matplotlib.collections.PolyCollection` per group (gid ``cells:F``, ``cells:B``,
``cells:I``, ``cells:W``, ``cells:pair-F``, ``cells:pair-B``), pair borders as ``pair-borders``, idle stretches as
``idle``, microbatch ids as one :class:`LabelCollection` (gid ``labels``), p2p hand-offs as ``comm``, a job's
communication lane (under each rank's cells, :func:`ppsim.viz._data.comm_lane`) as ``comm-lane`` (its track),
``comm-hidden`` and ``comm-exposed``, and the memory panel's lines with gid ``memory``: tests and users can find each
part by gid.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

import matplotlib as mpl
import numpy as np
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.legend_handler import HandlerBase
from matplotlib.patches import Rectangle
from matplotlib.path import Path as Path_
from matplotlib.text import Text
from matplotlib.textpath import TextPath
from matplotlib.ticker import FuncFormatter, MaxNLocator
from matplotlib.transforms import Affine2D, ScaledTranslation

from ppsim.io import write_atomic
from ppsim.result import COMP_TYPES
from ppsim.viz import (
    _data,
    _mpl,  # noqa: F401  (first: imports matplotlib's figure modules quickly)
    _text,
)
from ppsim.viz._data import (
    COLORS,
    COMM_COLORS,
    COMM_LABELS,
    COMM_LANE_COLOR,
    COMM_PARTS,
    DIGIT_COLORS,
    GROUP_KIND,
    GROUPS,
    IDLE_EDGE,
    LEGEND_LABELS,
    RECOMPUTE_HATCH,
    RECOMPUTE_HATCH_COLOR,
    RECOMPUTE_LABEL,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ppsim.result import SimResult

# Layout in inches (a one-unit cell is square, as in the DualPipe figures).
ROW_HEIGHT = 0.28
UNIT_WIDTH = 0.26
MIN_WIDTH = 5.0
MAX_WIDTH = 60.0
LABEL_FONT = 10.0
MIN_LABEL_FONT = 5.0  # below this for the typical cell a chart gets no digits
MIN_CELL_LABEL_FONT = 4.0  # a label shrunk to fit a narrow cell is dropped only below this
ROW_LABEL_FONT = 10.0
EDGE_WIDTH = 0.8
MAX_GANTT_HEIGHT = 24.0  # inches: beyond 85 ranks rows get thinner instead of the figure taller
#: Above this many computations the rows are one image (a pixel column shows what runs at its centre time), not a
#: rectangle per cell: a 1M-action chart then draws in about as long as a 50k-action one.
MAX_DRAWN_CELLS = 50_000
MAX_DENSE_COLUMNS = 12_000  # the widest chart (MAX_WIDTH) at 200 dpi
MAX_PIXELS = 16e6  # a saved figure's pixels (64 MB of RGBA): time and memory stay bounded
DIGIT_WIDTH_EM = 0.62  # width of one digit in ems (Helvetica/Arial/DejaVu: 0.556-0.636)


def _rc() -> dict[str, Any]:
    return {
        "font.family": list(_text.base_families()),
        "svg.fonttype": "none",  # text stays text in SVG (editable, small)
        "pdf.fonttype": 42,  # TrueType in PDF (publishers reject Type 3)
        "ps.fonttype": 42,
    }


@dataclass(frozen=True)
class _Swatch:
    """A legend key drawn like a cell: one fill (or a pair's two), a black border, optionally a digit."""

    fills: tuple[str, ...]
    width: float = 1.0  # share of the legend handle's width (never narrower than square)
    digit: str | None = None
    digit_color: str = "#000000"
    hatch: str | None = None
    height: float = 1.0  # share of the handle's height (a lane's strip is thin), at its bottom


class _SwatchHandler(HandlerBase):
    def legend_artist(self, legend: Any, orig_handle: _Swatch, fontsize: float, handlebox: Any) -> Any:
        w = max(handlebox.height, handlebox.width * orig_handle.width)
        h = handlebox.height * orig_handle.height
        x0, y0 = handlebox.xdescent * -1, handlebox.ydescent * -1
        n = len(orig_handle.fills)
        shares = (1.0,) if n == 1 else (1 / 3, 2 / 3)  # a pair: forward one cell, backward two
        x = x0
        for fill, share in zip(orig_handle.fills, shares):
            handlebox.add_artist(Rectangle((x, y0), w * share, h, facecolor=fill, edgecolor="none",
                                           transform=handlebox.get_transform()))
            x += w * share
        if orig_handle.hatch:
            handlebox.add_artist(Rectangle((x0, y0), w, h, facecolor="none", edgecolor=RECOMPUTE_HATCH_COLOR,
                                           linewidth=0.0, hatch=orig_handle.hatch,
                                           transform=handlebox.get_transform()))
        border = Rectangle((x0, y0), w, h, facecolor="none", edgecolor="black", linewidth=EDGE_WIDTH,
                           transform=handlebox.get_transform())
        handlebox.add_artist(border)
        if orig_handle.digit is not None:
            handlebox.add_artist(Text(x0 + w / 2, y0 + h / 2, orig_handle.digit, ha="center",
                                               va="center_baseline", color=orig_handle.digit_color,
                                               fontsize=fontsize, transform=handlebox.get_transform()))
        return border


@dataclass(frozen=True)
class _Legend:
    handles: list[_Swatch]
    labels: list[str]


def _present_groups(result: SimResult) -> set[str]:
    """The cell groups a result holds, read from its trace (no cells built)."""
    t = result.trace
    single = np.ones(t.comp_type.size, dtype=bool)
    single[t.pair_first] = False
    single[t.pair_first + 1] = False
    groups = {COMP_TYPES[k] for k in np.unique(t.comp_type[single]).tolist()}
    if t.pair_first.size:
        groups |= {"pair-F", "pair-B"}
    return groups


def legend_entries(result: SimResult, cells: list[_data.Cell] | None = None) -> _Legend:
    """Legend keys for what this schedule contains (in the figures' order), then the digit colours."""
    present = _present_groups(result) if cells is None else {c.group for c in cells}
    handles: list[_Swatch] = []
    labels: list[str] = []
    for kind, width in (("F", 0.5), ("B", 1.0), ("I", 0.5), ("W", 0.5)):
        if kind in present:
            handles.append(_Swatch((COLORS[kind],), width=width))
            labels.append(LEGEND_LABELS[kind])
    if "pair-F" in present:
        handles.append(_Swatch((COLORS["F"], COLORS["B"]), width=1.0))
        labels.append(LEGEND_LABELS["pair"])
    if result.recompute and (cells is None or any(c.recomputed for c in cells)):
        handles.append(_Swatch((COLORS["B"],), width=1.0, hatch=RECOMPUTE_HATCH))
        labels.append(RECOMPUTE_LABEL)
    if result.comm_spans and not (cells is None and is_dense(result)):  # the lane, where drawn
        strips = _data.comm_lane(result)
        present_parts = {span.part for span in strips}
        for part in COMM_PARTS:
            if part in present_parts:
                handles.append(_Swatch((COMM_COLORS[part],), width=1.0, height=0.35))
                labels.append(COMM_LABELS[part])
        if any(span.across for span in strips):
            handles.append(_Swatch((COMM_COLORS["exposed"],), width=1.0, height=0.35, hatch=_data.ACROSS_HATCH))
            labels.append(_data.ACROSS_LABEL)
    key = _data.digit_key(result)
    if key.by is not None and not (cells is None and is_dense(result)):  # a dense chart has no digits
        handles.append(_Swatch((COLORS["F"],), width=0.5, digit="0", digit_color=DIGIT_COLORS[0]))
        labels.append(key.black)
        handles.append(_Swatch((COLORS["F"],), width=0.5, digit="0", digit_color=DIGIT_COLORS[1]))
        labels.append(key.white)
    return _Legend(handles, labels)


class LabelCollection(PathCollection):
    """Microbatch ids drawn as glyph outlines, one artist for all of them (thousands of Text artists are slow).

    ``texts`` holds the strings in drawing order, aligned with ``get_offsets()`` (cell centres in data coordinates)
    and ``get_facecolors()`` (black or white digits); ``fontsizes`` the size of each in points (a label too long
    for its cell is set smaller rather than dropped) and ``fontsize`` the largest.
    """

    def __init__(
        self, paths: list[Path_], texts: list[str], *, fontsizes: list[float], **kwargs: Any
    ) -> None:
        super().__init__(paths, **kwargs)
        self.texts = tuple(texts)
        self.fontsizes = tuple(fontsizes)
        self.fontsize = max(fontsizes, default=0.0)

    @classmethod
    def for_cells(
        cls, ax: Axes, cells: list[_data.Cell], *, fontsize: float, fontsizes: list[float] | None = None,
        y_offset: float = 0.0,
    ) -> LabelCollection:
        sizes = [fontsize] * len(cells) if fontsizes is None else fontsizes
        glyphs: dict[tuple[str, float], Path_] = {}
        texts = [str(c.microbatch) for c in cells]
        for key in set(zip(texts, sizes)):  # centred on the ink horizontally, on a digit's height vertically
            text, size = key
            prop = FontProperties(size=size)
            zero = TextPath((0, 0), "0", size=size, prop=prop).get_extents()
            path = TextPath((0, 0), text, size=size, prop=prop)
            ext = path.get_extents()
            glyphs[key] = path.transformed(Affine2D().translate(-(ext.x0 + ext.x1) / 2, -(zero.y0 + zero.y1) / 2))
        return cls(
            [glyphs[k] for k in zip(texts, sizes)],
            texts,
            fontsizes=sizes,
            offsets=np.array([((c.start + c.end) / 2, c.rank + y_offset) for c in cells], dtype=float),
            offset_transform=ax.transData,
            transform=Affine2D().scale(1 / 72) + ax.figure.dpi_scale_trans,  # glyphs in points
            facecolors=[DIGIT_COLORS[c.shade] for c in cells],
            edgecolors="none",
            zorder=4,
            gid="labels",
        )


def _axes_width_pt(ax: Axes) -> float:
    return ax.get_position().width * ax.figure.get_figwidth() * 72.0


def _base_duration(cells: list[_data.Cell]) -> float:
    """The duration drawn one unit (cell) wide: the typical forward, else the typical cell."""
    forwards = [c.end - c.start for c in cells if c.group == "F" and c.end > c.start]
    durations = forwards or [c.end - c.start for c in cells if c.end > c.start]
    return median(durations) if durations else 1.0


def natural_width(
    result: SimResult, *, time_max: float | None = None, cells: list[_data.Cell] | None = None
) -> float:
    """Axes width in inches that gives a one-forward cell :data:`UNIT_WIDTH`, clamped to a printable range."""
    span = time_max or result.makespan or 1.0
    if cells is None and is_dense(result):
        return MAX_WIDTH
    units = span / _base_duration(_data.cells(result) if cells is None else cells)
    return float(min(MAX_WIDTH, max(MIN_WIDTH, units * UNIT_WIDTH)))


def _rects(
    rows: np.ndarray, x0: np.ndarray, x1: np.ndarray, band: tuple[float, float] = (-0.5, 0.5)
) -> np.ndarray:
    """Rectangles from ``x0`` to ``x1`` on rows ``rows``, spanning ``band`` (offsets from the row's index)."""
    top, bottom = rows + band[0], rows + band[1]
    return np.stack(
        [np.stack([x0, top], 1), np.stack([x1, top], 1), np.stack([x1, bottom], 1), np.stack([x0, bottom], 1)], 1
    )


def draw_gantt(
    result: SimResult,
    ax: Axes,
    *,
    labels: bool | None = None,
    comm: bool = False,
    row_label: str = "Device",
    time_max: float | None = None,
    label_fontsize: float | None = None,
    cells: list[_data.Cell] | None = None,
) -> None:
    """Draw the Gantt rows into ``ax`` (no legend, no title). ``labels=None`` labels every cell a digit fits in.

    Above :data:`MAX_DRAWN_CELLS` computations the rows are drawn as one image instead (see :func:`_draw_dense`),
    so the work and memory a figure takes are bounded by its pixels, not by the schedule's size.
    """
    span = time_max if time_max is not None else (result.makespan or 1.0)
    ts = _data.time_scale(result, span=span)
    layout = _layout(result, cells)
    if cells is None and is_dense(result):
        _draw_dense(result, ax, span)
        if comm:
            ax.annotate(f"p2p arrows not drawn above {MAX_DRAWN_CELLS:,} cells", xy=(1, 1), xycoords="axes fraction",
                        xytext=(0, 4), textcoords="offset points", ha="right", va="bottom", fontsize=8,
                        color="#444444")
    else:
        _draw_cells(result, ax, _data.cells(result) if cells is None else cells, span=span, labels=labels,
                    label_fontsize=label_fontsize, layout=layout)
        if comm:
            _draw_comm(result, ax, layout.centre)
        if layout.lane is not None:
            _draw_comm_lane(result, ax, layout.lane)
    _style_axes(result, ax, span=span, ts=ts, row_label=row_label, centre=layout.centre)


def _layout(result: SimResult, cells: list[_data.Cell] | None) -> _data.RowLayout:
    """The rows' layout: with a communication lane where the result has collectives and the chart draws cells."""
    return _data.PLAIN_ROWS if cells is None and is_dense(result) else _data.row_layout(result)


def _draw_cells(
    result: SimResult, ax: Axes, cells: list[_data.Cell], *, span: float, labels: bool | None,
    label_fontsize: float | None, layout: _data.RowLayout = _data.PLAIN_ROWS,
) -> None:
    """One rectangle per cell, pair borders, idle slots and the microbatch ids, in ``layout.compute``."""
    band = layout.compute
    pt_per_time = _axes_width_pt(ax) / span

    # edges thin out and then vanish as cells shrink, so dense charts stay colour fields, not black mush
    unit_pt = _base_duration(cells) * pt_per_time
    edge = EDGE_WIDTH if unit_pt >= 8 else (0.4 if unit_pt >= 3 else 0.0)

    gaps = _idle_slots(_data.idle_gaps(result), _base_duration(cells))
    if gaps and edge > 0:
        g = np.array(gaps, dtype=float).reshape(-1, 3)
        ax.add_collection(PolyCollection(_rects(g[:, 0], g[:, 1], g[:, 2], band), facecolors="white",
                                         edgecolors=IDLE_EDGE, linewidths=edge * 0.6, zorder=1, gid="idle"))
    for group in GROUPS:
        sel = [c for c in cells if c.group == group]
        if not sel:
            continue
        a = np.array([(c.rank, c.start, c.end) for c in sel], dtype=float)
        pair = group.startswith("pair-")
        ax.add_collection(PolyCollection(
            _rects(a[:, 0], a[:, 1], a[:, 2], band),
            facecolors=COLORS[GROUP_KIND[group]],
            edgecolors="none" if pair else "black",
            linewidths=0.0 if pair else edge,
            joinstyle="miter",
            zorder=2,
            gid=f"cells:{group}",
            label=f"_{group}",
        ))
    hatched = [c for c in cells if c.recomputed]
    if hatched:  # over the fill, under the pair borders and digits
        h = np.array([(c.rank, c.start, c.end) for c in hatched], dtype=float)
        ax.add_collection(PolyCollection(_rects(h[:, 0], h[:, 1], h[:, 2], band), facecolors="none",
                                         edgecolors=RECOMPUTE_HATCH_COLOR, linewidths=0.0, hatch=RECOMPUTE_HATCH,
                                         zorder=2.5, gid="recompute"))
    borders = _data.pair_borders(result)
    if borders and edge > 0:
        b = np.array(borders, dtype=float)
        ax.add_collection(PolyCollection(_rects(b[:, 0], b[:, 1], b[:, 2], band), facecolors="none",
                                         edgecolors="black", linewidths=edge, joinstyle="miter",
                                         zorder=3, gid="pair-borders"))

    if labels is not False and cells:
        ndig = max(len(str(c.microbatch)) for c in cells)
        fs = label_fontsize or LABEL_FONT
        if label_fontsize is None:  # shrink to fit the typical cell, down to a legible floor
            fs = min(fs, (unit_pt - 2.0) / (ndig * DIGIT_WIDTH_EM))
        if fs >= MIN_LABEL_FONT or labels is True:
            fs = max(fs, 1.0)

            def fitted(c: _data.Cell) -> float:
                """The label size for this cell: ``fs``, or smaller where its digits would overflow the cell."""
                room = (c.end - c.start) * pt_per_time - 1.5
                return min(fs, room / (len(str(c.microbatch)) * DIGIT_WIDTH_EM))

            # a label too long for its cell (two digits in a narrow one) is set smaller, down to a legible floor,
            # and rounded to a quarter point so a chart needs only a few glyph sizes
            sized = [(c, fs if labels is True else math.floor(fitted(c) * 4) / 4) for c in cells]
            shown = [(c, size) for c, size in sized if labels is True or size >= MIN_CELL_LABEL_FONT]
            if shown:
                ax.add_collection(
                    LabelCollection.for_cells(ax, [c for c, _ in shown], fontsize=fs,
                                              fontsizes=[size for _, size in shown], y_offset=layout.centre),
                    autolim=False,
                )



def _style_axes(
    result: SimResult, ax: Axes, *, span: float, ts: _data.TimeScale, row_label: str, centre: float = 0.0
) -> None:
    n = result.schedule.num_ranks
    ax.set_xlim(0, span)
    ax.set_ylim(n - 0.5, -0.5)
    # a row label every row while rows are tall enough for one, else every k-th row
    row_pt = ax.get_position().height * ax.figure.get_figheight() * 72.0 / n
    step = max(1, math.ceil(ROW_LABEL_FONT * 1.3 / row_pt))
    ax.set_yticks([r + centre for r in range(0, n, step)], [f"{row_label} {r}" for r in range(0, n, step)],
                  fontsize=ROW_LABEL_FONT, fontweight="bold")
    ax.tick_params(axis="y", length=0, pad=5)
    ax.tick_params(axis="x", labelsize=8, colors="#444444", length=3, width=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=result.unit != "s"))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v * ts.factor:g}"))
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.annotate("Time →", xy=(0, 0), xycoords="axes fraction", xytext=(-9, -11), textcoords="offset points",
                ha="right", va="center", fontsize=ROW_LABEL_FONT, fontweight="bold")
    ax.annotate(ts.label.removeprefix("Time (").removesuffix(")"), xy=(1, 0), xycoords="axes fraction",
                xytext=(0, -24), textcoords="offset points", ha="right", va="center", fontsize=8, color="#444444")


def bounded_dpi(fig: Figure, dpi: float) -> float:
    """``dpi``, lowered where the figure would exceed :data:`MAX_PIXELS` pixels (memory and time stay bounded)."""
    w, h = fig.get_size_inches()
    return float(min(dpi, math.sqrt(MAX_PIXELS / max(w * h, 1e-9))))


def is_dense(result: SimResult) -> bool:
    """Whether the chart has more computations than are drawn one by one."""
    return int(result.trace.comp_type.size) > MAX_DRAWN_CELLS


def _draw_dense(result: SimResult, ax: Axes, span: float) -> None:
    """Every rank's row as one image row: each pixel column takes the colour of what runs at its centre time.

    Used above :data:`MAX_DRAWN_CELLS` computations, where cells are narrower than a pixel anyway: no borders, no
    digits, idle time white. The image is ``(ranks, columns)`` with columns the axes' width at 200 dpi (at most
    :data:`MAX_DENSE_COLUMNS`), so drawing and saving take time and memory bounded by the figure, not the schedule.
    """
    t = result.trace
    n = result.schedule.num_ranks
    columns = int(min(MAX_DENSE_COLUMNS, max(100, ax.get_position().width * ax.figure.get_figwidth() * 200)))
    centres = (np.arange(columns) + 0.5) * (span / columns)
    kind = np.full((n, columns), len(COMP_TYPES), dtype=np.int8)  # last index: idle
    starts, ends, types = t.comp_half_start, t.comp_half_end, t.comp_type
    bounds = np.searchsorted(t.comp_owner, t.offsets)  # computations of rank r: bounds[r] .. bounds[r + 1]
    for rank in range(n):
        a, b = bounds[rank], bounds[rank + 1]
        if a == b:
            continue
        i = np.searchsorted(starts[a:b], centres, side="right") - 1  # a rank's computations run in order
        ok = i >= 0
        ok[ok] = centres[ok] < ends[a:b][i[ok]]
        kind[rank, ok] = types[a:b][i[ok]]
    palette = np.array([to_rgba(COLORS[k]) for k in COMP_TYPES] + [(1.0, 1.0, 1.0, 1.0)])
    ax.imshow((palette[kind] * 255).astype(np.uint8), aspect="auto", interpolation="nearest",
              extent=(0, span, n - 0.5, -0.5), zorder=2, gid="cells:dense")


def _idle_slots(gaps: list[tuple[int, float, float]], base: float) -> list[tuple[int, float, float]]:
    """Idle stretches cut into one-cell slots where they are whole multiples of a cell (as the figures draw them)."""
    out: list[tuple[int, float, float]] = []
    for rank, a, b in gaps:
        n = round((b - a) / base) if base > 0 else 0
        if 1 < n <= 64 and abs((b - a) - n * base) <= 1e-9 * max(b, 1.0):
            out.extend((rank, a + i * base, a + (i + 1) * base) for i in range(n))
        else:
            out.append((rank, a, b))
    return out


def _draw_comm(result: SimResult, ax: Axes, centre: float = 0.0) -> None:
    tr = result.transfers()
    if tr.empty:
        return
    x = tr["send"].to_numpy(float)
    y = tr["src_rank"].to_numpy(float) + centre
    dx = tr["arrive"].to_numpy(float) - x
    dy = tr["dst_rank"].to_numpy(float) + centre - y
    colors = np.where(tr["kind"].to_numpy() == "F", "#8a5a00", "#2f6b12")
    ax.quiver(x, y, dx, dy, angles="xy", scale_units="xy", scale=1, color=list(colors), units="inches",
              width=0.01, headwidth=4, headlength=5, headaxislength=4.5, alpha=0.7, zorder=5, gid="comm")


def _draw_comm_lane(result: SimResult, ax: Axes, lane: tuple[float, float]) -> None:
    """The communication lane in ``lane`` under each rank's cells: a light track over the whole step, and on it the
    strips of :func:`ppsim.viz._data.comm_lane` (each action's collectives, hidden light from its start, exposed
    strong at its end)."""
    n = result.schedule.num_ranks
    ranks = np.arange(n, dtype=float)
    ax.add_collection(PolyCollection(_rects(ranks, np.zeros(n), np.full(n, result.makespan), lane),
                                     facecolors=COMM_LANE_COLOR, edgecolors="none", zorder=1, gid="comm-lane"))
    strips = _data.comm_lane(result)
    for part in COMM_PARTS:
        for across in (False, True):
            sel = [(s.rank, s.start, s.end) for s in strips if s.part == part and s.across == across]
            if sel:
                a = np.array(sel, dtype=float)
                ax.add_collection(PolyCollection(
                    _rects(a[:, 0], a[:, 1], a[:, 2], lane), facecolors=COMM_COLORS[part],
                    edgecolors="white" if across else "none", linewidths=0,
                    hatch=_data.ACROSS_HATCH if across else None,
                    zorder=4.5, gid=f"comm-{part}" + ("-across" if across else "")))


def draw_memory(result: SimResult, ax: Axes, *, row_label: str = "Device", time_max: float | None = None) -> None:
    """Memory over time per rank: bytes with a profile, else held stage-chunk activations (step lines)."""
    mem = result.memory()
    use_bytes = bool(mem["bytes"].notna().any())
    column = "bytes" if use_bytes else "activations"
    scale, ylabel = (2.0**-30, "Memory (GiB)") if use_bytes else (1.0, "Activations held")
    span = time_max if time_max is not None else result.makespan
    n = result.schedule.num_ranks
    cmap = mpl.colormaps["tab10" if n <= 10 else "viridis"]
    for rank, frame in mem.groupby("rank", sort=True):
        t = np.append(frame["time"].to_numpy(float), result.makespan)
        v = frame[column].to_numpy(float) * scale
        v = np.append(v, v[-1])
        color = cmap(rank) if n <= 10 else cmap(rank / max(n - 1, 1))
        ax.step(t, v, where="post", color=color, linewidth=1.2, label=f"{row_label} {rank}", gid="memory")
    if use_bytes and result.memory_cap_bytes:
        ax.axhline(result.memory_cap_bytes * scale, color="#d62728", linestyle="--", linewidth=1, label="cap")
    ax.set_xlim(0, span)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel, fontsize=9)
    ts = _data.time_scale(result, span=span)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v * ts.factor:g}"))
    ax.tick_params(labelsize=8, colors="#444444")
    if not use_bytes:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if n <= 10:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def _legend_columns(entries: _Legend, width_in: float, fontsize: float) -> int:
    """Columns that fit in ``width_in`` (greedy estimate from text lengths)."""
    widths = [(len(t) * 0.62 + 6.0) * fontsize / 72.0 for t in entries.labels]
    avail = width_in
    best = 1
    for ncol in range(len(widths), 0, -1):
        rows = [widths[i:i + ncol] for i in range(0, len(widths), ncol)]
        col_w = [max(r[c] for r in rows if c < len(r)) for c in range(ncol)]
        if sum(col_w) <= avail:
            best = ncol
            break
    return best


def add_legend(
    result: SimResult, ax: Axes, *, fontsize: float = 10.0, ncol: int | None = None,
    cells: list[_data.Cell] | None = None,
) -> Any:
    """The DualPipe-figure legend, centred below ``ax`` and its time axis."""
    entries = legend_entries(result, cells)
    width_in = ax.get_position().width * ax.figure.get_figwidth()
    ncol = ncol or _legend_columns(entries, width_in + 1.0, fontsize)
    order = _row_major(len(entries.labels), ncol)  # matplotlib fills columns first; read rows left to right
    return ax.legend(
        [entries.handles[i] for i in order], [entries.labels[i] for i in order],
        handler_map={_Swatch: _SwatchHandler()}, loc="upper center", bbox_to_anchor=(0.5, 0.0),
        bbox_transform=_below(ax, 30), ncol=ncol, frameon=False, handlelength=3.0, handleheight=1.6,
        handletextpad=0.8, columnspacing=2.0, prop={"weight": "bold", "size": fontsize},
    )


def _row_major(n: int, ncol: int) -> list[int]:
    """Entry order that makes a column-major legend of ``ncol`` columns read row by row."""
    nrows = -(-n // ncol)
    grid = [[r * ncol + c for r in range(nrows) if r * ncol + c < n] for c in range(ncol)]
    return [i for column in grid for i in column]


def _below(ax: Axes, points: float) -> Any:
    """Axes coordinates shifted down by ``points`` (below the tick labels)."""
    return ax.transAxes + ScaledTranslation(0, -points / 72.0, ax.figure.dpi_scale_trans)


def plot_gantt(
    result: SimResult,
    *,
    ax: Axes | None = None,
    memory: bool = False,
    comm: bool = False,
    labels: bool | None = None,
    legend: bool = True,
    title: bool | str = True,
    row_label: str = "Device",
    width: float | None = None,
    time_max: float | None = None,
) -> Figure:
    """The Gantt chart of ``result`` (with ``memory=True`` a memory-over-time panel below it); returns the figure.

    With ``ax`` the chart is drawn into it (``memory`` then needs a figure of its own: use :func:`plot_memory`);
    ``labels=None`` writes a microbatch id in every cell it fits in, ``True`` in every cell, ``False`` in none.
    ``width`` is the chart width in inches (default: a one-forward cell is square, within 5-60 in);
    ``time_max`` fixes the time axis (to compare schedules on one scale).
    """
    if ax is not None and memory:
        raise ValueError("memory=True draws a second panel and needs a figure of its own: drop ax, or call "
                         "plot_memory(result, ax=another_ax)")
    with mpl.rc_context(_rc()):
        if ax is not None:
            cells = None if is_dense(result) else _data.cells(result)
            draw_gantt(result, ax, labels=labels, comm=comm, row_label=row_label, time_max=time_max, cells=cells)
            if legend:
                add_legend(result, ax, cells=cells)
            if title:
                width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72.0
                fitted = _text.fit_title(title if isinstance(title, str) else _data.title(result), width_pt)
                ax.set_title(fitted.text, loc="left", fontsize=fitted.fontsize, fontfamily=list(fitted.families),
                             parse_math=False)
            return ax.figure  # type: ignore[return-value]
        return _own_figure(result, memory=memory, comm=comm, labels=labels, legend=legend, title=title,
                           row_label=row_label, width=width, time_max=time_max)


def _own_figure(
    result: SimResult, *, memory: bool, comm: bool, labels: bool | None, legend: bool, title: bool | str,
    row_label: str, width: float | None, time_max: float | None,
) -> Figure:
    n = result.schedule.num_ranks
    cells = None if is_dense(result) else _data.cells(result)
    axes_w = width or natural_width(result, time_max=time_max, cells=cells)
    left = 0.95 if n <= 10 else 1.05
    right = 1.2 if memory else 0.2
    fig_w = left + axes_w + right
    entries = legend_entries(result, cells)
    ncol = _legend_columns(entries, axes_w + left, 10.0)
    legend_rows = -(-len(entries.labels) // ncol) if legend else 0
    fitted = None
    if title:  # from the axes' left edge to the figure's right edge, wrapped or set smaller when it is long
        fitted = _text.fit_title(title if isinstance(title, str) else _data.title(result), (fig_w - left - 0.1) * 72)
    title_h = 0.42 + (fitted.num_lines - 1) * fitted.fontsize * 1.25 / 72 if fitted else 0.1
    gantt_h = min(n * ROW_HEIGHT * _layout(result, cells).height_scale, MAX_GANTT_HEIGHT)
    ticks_h = 0.45
    legend_h = 0.36 * legend_rows + (0.12 if legend else 0.0)
    mem_h = 1.6 if memory else 0.0
    mem_ticks = 0.4 if memory else 0.0
    fig_h = title_h + gantt_h + ticks_h + legend_h + mem_h + mem_ticks + 0.08
    fig = Figure(figsize=(fig_w, fig_h))
    y_top = fig_h - title_h
    ax = fig.add_axes((left / fig_w, (y_top - gantt_h) / fig_h, axes_w / fig_w, gantt_h / fig_h))
    draw_gantt(result, ax, labels=labels, comm=comm, row_label=row_label, time_max=time_max, cells=cells)
    if legend:
        add_legend(result, ax, ncol=ncol, cells=cells)
    if fitted:
        fig.text(left / fig_w, 1 - 0.14 / fig_h, fitted.text, ha="left", va="top", fontsize=fitted.fontsize,
                 fontfamily=list(fitted.families), parse_math=False, gid="title")
    if memory:
        mem_ax = fig.add_axes((left / fig_w, mem_ticks / fig_h, axes_w / fig_w, mem_h / fig_h))
        draw_memory(result, mem_ax, row_label=row_label, time_max=time_max)
    return fig


def plot_memory(result: SimResult, *, ax: Axes | None = None, row_label: str = "Device") -> Figure:
    """Memory over time per rank (held activations, or bytes with a profile); returns the figure."""
    with mpl.rc_context(_rc()):
        if ax is None:
            fig = Figure(figsize=(natural_width(result) + 1.6, 2.2), layout="constrained")
            ax = fig.add_subplot()
        draw_memory(result, ax, row_label=row_label)
        ax.set_xlabel(_data.time_scale(result).label, fontsize=9)
        return ax.figure  # type: ignore[return-value]


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int = 200) -> Path:
    """Write ``fig`` as png/svg/pdf (chosen by extension) with ppsim's one atomic writer."""
    fmt = Path(path).suffix.lower().lstrip(".")
    extra: dict[str, Any] = {
        "png": {"pil_kwargs": {"compress_level": 3}},  # 40% faster than the default, ~10% larger
        "svg": {"metadata": {"Date": None}},  # byte-identical reruns
        "pdf": {"metadata": {"CreationDate": None}},
    }[fmt]

    # rendered in memory first, so the hidden temporary file lives for the write alone (milliseconds, not the
    # seconds a big figure takes to draw): a process killed outright (SIGKILL) rarely leaves one behind
    buffer = io.BytesIO()
    with mpl.rc_context(_rc()):
        fig.savefig(buffer, format=fmt, dpi=dpi, facecolor="white", **extra)
    return write_atomic(path, buffer.getvalue())
