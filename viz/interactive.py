"""Interactive Gantt charts (plotly): hover, zoom, legend toggles, an optional memory panel, offline HTML.

One bar trace per cell group (``F``, ``B``, ``I``, ``W`` and the two halves of overlapped pairs) plus one trace of
pair borders, never one trace per rectangle, so a 20,000-action schedule stays a small, fast page. Trace ``meta``
holds the group name (``"F"``, ``"pair-F"``, ``"pair-border"``, ``"memory"``, ``"comm"``) for tests and scripts.
A step with collectives (a torchtitan job's EP all-to-alls, FSDP's gathers) has the static figure's communication
lane under each rank's cells, from the same strips (:func:`ppsim.viz._data.comm_lane`): ``"comm-lane"`` (the
track), ``"comm-hidden"`` and ``"comm-exposed"`` (hover: kind, action, total, exposed, hidden).
A backward that recomputes its forward (:mod:`ppsim.recompute`) is hatched: its bar's ``marker.pattern.shape`` is
``"/"`` (``""`` for the others).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go

from ppsim.io import write_atomic
from ppsim.viz import _data
from ppsim.viz._data import (
    COLORS,
    COMM_COLORS,
    COMM_LABELS,
    COMM_LANE_COLOR,
    COMM_PARTS,
    DIGIT_COLORS,
    GROUP_KIND,
    GROUPS,
    LEGEND_LABELS,
    PAIR_LABEL,
    RECOMPUTE_HATCH_COLOR,
)

if TYPE_CHECKING:
    from ppsim.result import SimResult

#: Above this many cells a chart carries no digits (hover still names every cell); browsers stay responsive.
MAX_LABELLED_CELLS = 6000
#: Labels shrink to fit their cells (all to one size, as in the DualPipe figures) and are hidden only below this
#: many px: two-digit ids in one-unit cells of a 4-rank, 16-microbatch report 1600 px wide need about 7 px.
MIN_LABEL_PX = 5
HOVER_FIELDS = ("action", "stage", "microbatch", "start", "end", "duration")
PLOTLY_CONFIG = {"displaylogo": False, "scrollZoom": True, "responsive": True,
                 "toImageButtonOptions": {"format": "svg"}}
_HOVER = (
    "<b>%{customdata[0]}</b> (%{customdata[6]})<br>"
    "stage %{customdata[1]}, microbatch %{customdata[2]}<br>"
    "start %{customdata[3]:.6g}, end %{customdata[4]:.6g}<br>"
    "duration %{customdata[5]:.6g}%{meta[1]}<extra>%{meta[2]} %{customdata[7]}</extra>"
)
_LANE_HOVER = (
    "<b>%{customdata[0]}</b> (%{meta[3]} part) in %{customdata[1]}<br>"
    "total %{customdata[2]:.6g}%{meta[1]}, exposed %{customdata[3]:.6g}%{meta[1]}, "
    "hidden %{customdata[4]:.6g}%{meta[1]}<extra>%{meta[2]} %{customdata[5]}</extra>"
)
_KIND_WORDS = {"F": "forward", "B": "backward", "I": "backward for input", "W": "backward for weights"}


def _row_px(num_ranks: int) -> int:
    return int(max(12, min(32, 640 / max(num_ranks, 1))))


def _edge_px(result: SimResult, cells: list[_data.Cell]) -> float:
    """Border width in px: 1, then thinner, then none as typical cells shrink on a ~1200 px wide chart."""
    durations = sorted(c.end - c.start for c in cells if c.end > c.start)
    if not durations or result.makespan <= 0:
        return 1.0
    px = durations[len(durations) // 2] / result.makespan * 1200
    return 1.0 if px >= 6 else (0.5 if px >= 3 else 0.0)


def add_gantt_traces(
    fig: go.Figure,
    result: SimResult,
    *,
    row: int | None = None,
    labels: bool | None = None,
    row_label: str = "Device",
    legend: bool = True,
    legendgroup_prefix: str = "",
    time_factor: float | None = None,
) -> None:
    """Add the Gantt's traces to ``fig`` (at subplot ``row`` if given) and set up its rank axis."""
    factor = _data.time_scale(result).factor if time_factor is None else time_factor
    unit = _data.suffix_for(result, factor)
    cells = _data.cells(result)
    with_text = labels is True or (labels is None and len(cells) <= MAX_LABELLED_CELLS)
    edge = _edge_px(result, cells)
    loc = {"row": row, "col": 1} if row is not None else {}
    layout = _data.row_layout(result)
    height = layout.compute[1] - layout.compute[0]
    for group in GROUPS:
        sel = [c for c in cells if c.group == group]
        if not sel:
            continue
        kind = GROUP_KIND[group]
        pair = group.startswith("pair-")
        start = np.fromiter((c.start for c in sel), float, len(sel)) * factor
        end = np.fromiter((c.end for c in sel), float, len(sel)) * factor
        a0 = np.fromiter((c.action_start for c in sel), float, len(sel)) * factor
        a1 = np.fromiter((c.action_end for c in sel), float, len(sel)) * factor
        custom = np.empty((len(sel), 8), dtype=object)
        custom[:, 0] = [c.action for c in sel]
        custom[:, 1] = [c.stage for c in sel]
        custom[:, 2] = [c.microbatch for c in sel]
        custom[:, 3] = a0
        custom[:, 4] = a1
        custom[:, 5] = a1 - a0
        custom[:, 6] = [_KIND_WORDS[c.kind] + (" half of an overlapped pair" if pair else "")
                        + (", recomputes its forward first" if c.recomputed else "") for c in sel]
        custom[:, 7] = [c.rank for c in sel]
        name = PAIR_LABEL if pair else LEGEND_LABELS[kind]
        bar: dict[str, Any] = dict(
            orientation="h",
            y=_rows(np.fromiter((c.rank for c in sel), np.int64, len(sel)), layout.centre),
            base=start,
            x=end - start,
            width=height,
            name=name,
            legendgroup=legendgroup_prefix + ("pair" if pair else group),
            showlegend=legend and group != "pair-B",
            marker=dict(color=COLORS[kind], line=dict(color="black", width=0 if pair else edge)),
            customdata=custom,
            hovertemplate=_HOVER,
            meta=[group, unit, row_label],
        )
        if any(c.recomputed for c in sel):
            bar["marker"]["pattern"] = dict(shape=["/" if c.recomputed else "" for c in sel],
                                            fgcolor=RECOMPUTE_HATCH_COLOR, size=6, solidity=0.25)
        if with_text:
            bar.update(
                text=[str(c.microbatch) for c in sel],
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                textfont=dict(color=[DIGIT_COLORS[c.shade] for c in sel]),
                constraintext="inside",
                cliponaxis=True,
            )
        else:
            bar.update(textposition="none")
        fig.add_trace(go.Bar(**bar), **loc)
    borders = _data.pair_borders(result)
    if borders and edge > 0:
        b = np.array(borders, dtype=float)
        fig.add_trace(
            go.Bar(
                orientation="h", y=_rows(b[:, 0].astype(np.int64), layout.centre), base=b[:, 1] * factor,
                x=(b[:, 2] - b[:, 1]) * factor, width=height, name=PAIR_LABEL,
                legendgroup=legendgroup_prefix + "pair", showlegend=False,
                marker=dict(color="rgba(0,0,0,0)", line=dict(color="black", width=1)), hoverinfo="skip",
                textposition="none", meta=["pair-border"],
            ),
            **loc,
        )
    if layout.lane is not None:
        add_lane_traces(fig, result, layout.lane, loc=loc, legend=legend, legendgroup_prefix=legendgroup_prefix,
                        factor=factor, unit=unit, row_label=row_label)
    n = result.schedule.num_ranks
    step = max(1, n // 32)
    fig.update_yaxes(
        tickvals=_rows(np.arange(0, n, step), layout.centre).tolist(),
        ticktext=[f"{row_label} {r}" for r in range(0, n, step)],
        range=[n - 0.5 + 0.04, -0.5 - 0.04],  # a hair of room so the outer borders are not clipped
        showgrid=False, zeroline=False, ticks="", tickfont=dict(size=12, color="black"),
        fixedrange=True, **loc,
    )


def _rows(ranks: np.ndarray, offset: float) -> np.ndarray:
    """Bar positions: the ranks (integers where nothing is shifted), moved by ``offset`` within their rows."""
    return ranks if offset == 0 else ranks + offset


def add_lane_traces(
    fig: go.Figure, result: SimResult, lane: tuple[float, float], *, loc: dict[str, int], legend: bool,
    legendgroup_prefix: str, factor: float, unit: str, row_label: str,
) -> None:
    """The communication lane (``lane``: its band in each rank's row) as the static figure draws it: a light track
    over the step, and one bar trace per part (hidden, exposed) of :func:`ppsim.viz._data.comm_lane`'s strips."""
    n = result.schedule.num_ranks
    centre, width = (lane[0] + lane[1]) / 2, lane[1] - lane[0]
    fig.add_trace(go.Bar(
        orientation="h", y=np.arange(n) + centre, base=np.zeros(n), x=np.full(n, result.makespan * factor),
        width=width, marker=dict(color=COMM_LANE_COLOR, line=dict(width=0)), hoverinfo="skip", showlegend=False,
        textposition="none", name="communication lane", meta=["comm-lane"],
    ), **loc)
    strips = _data.comm_lane(result)
    for part in COMM_PARTS:
        sel = [s for s in strips if s.part == part]
        if not sel:
            continue
        custom = np.empty((len(sel), 6), dtype=object)
        custom[:, 0] = [s.kind_words for s in sel]
        custom[:, 1] = [s.action for s in sel]
        custom[:, 2] = [s.total * factor for s in sel]
        custom[:, 3] = [s.exposed * factor for s in sel]
        custom[:, 4] = [(s.total - s.exposed) * factor for s in sel]
        custom[:, 5] = [s.rank for s in sel]
        start = np.fromiter((s.start for s in sel), float, len(sel)) * factor
        end = np.fromiter((s.end for s in sel), float, len(sel)) * factor
        fig.add_trace(go.Bar(
            orientation="h", y=np.fromiter((s.rank for s in sel), float, len(sel)) + centre, base=start,
            x=end - start, width=width, name=COMM_LABELS[part], legendgroup=legendgroup_prefix + f"comm-{part}",
            showlegend=legend, customdata=custom,
            marker=dict(color=COMM_COLORS[part], line=dict(width=0),
                        pattern=dict(shape=["/" if s.across else "" for s in sel])),  # across nodes: hatched
            hovertemplate=_LANE_HOVER, textposition="none", meta=[f"comm-{part}", unit, row_label, part],
        ), **loc)


def _rank_colors(n: int) -> list[str]:
    """One line colour per rank: matplotlib's tab10 up to 10 ranks (as the static panel), else viridis."""
    from plotly.colors import qualitative, sample_colorscale

    if n <= 10:
        return list(qualitative.D3[:n])
    return sample_colorscale("Viridis", [r / (n - 1) for r in range(n)])


def add_memory_traces(
    fig: go.Figure, result: SimResult, *, row: int | None = None, row_label: str = "Device",
    legend: bool = True, time_factor: float | None = None,
) -> None:
    """Memory over time per rank (bytes with a profile, else held activations) as step lines."""
    mem = result.memory()
    use_bytes = bool(mem["bytes"].notna().any())
    if use_bytes:
        column, scale, title = "bytes", 2.0**-30, "Memory (GiB)"
    else:
        column, scale, title = "activations", 1.0, "Activations held"
    factor = _data.time_scale(result).factor if time_factor is None else time_factor
    loc = {"row": row, "col": 1} if row is not None else {}
    n = result.schedule.num_ranks
    palette = _rank_colors(n)
    for rank, frame in mem.groupby("rank", sort=True):
        t = np.append(frame["time"].to_numpy(float), result.makespan) * factor
        v = frame[column].to_numpy(float) * scale
        v = np.append(v, v[-1])
        fig.add_trace(
            go.Scatter(
                x=t, y=v, mode="lines", line=dict(shape="hv", width=1.5, color=palette[int(rank)]),
                name=f"memory, {row_label} {rank}",
                showlegend=legend and n <= 16, meta=["memory", rank],
                hovertemplate=f"{row_label} {rank}<br>t %{{x:.6g}}<br>{title.lower()} %{{y:.6g}}<extra></extra>",
            ),
            **loc,
        )
    if use_bytes and result.memory_cap_bytes:
        fig.add_hline(y=result.memory_cap_bytes * scale, line=dict(color="#d62728", dash="dash", width=1),
                      annotation_text="memory cap", **loc)
    fig.update_yaxes(title_text=title, rangemode="tozero", **loc)


def add_comm_traces(fig: go.Figure, result: SimResult, *, row: int | None = None,
                    time_factor: float | None = None) -> None:
    """p2p hand-offs as arrows from the producer's end (its rank) to the arrival (consumer's rank)."""
    tr = result.transfers()
    if tr.empty:
        return
    factor = _data.time_scale(result).factor if time_factor is None else time_factor
    n = len(tr)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    x[0::3], x[1::3] = tr["send"].to_numpy(float) * factor, tr["arrive"].to_numpy(float) * factor
    centre = _data.row_layout(result).centre
    y[0::3], y[1::3] = tr["src_rank"].to_numpy(float) + centre, tr["dst_rank"].to_numpy(float) + centre
    size = np.zeros(3 * n)
    size[1::3] = 7
    loc = {"row": row, "col": 1} if row is not None else {}
    fig.add_trace(
        go.Scatter(x=x, y=y, mode="lines+markers", name="p2p hand-offs", line=dict(color="rgba(40,40,40,0.6)", width=1),
                   marker=dict(symbol="arrow", angleref="previous", size=size, color="rgba(40,40,40,0.8)"),
                   hoverinfo="skip", meta=["comm"], visible=True),
        **loc,
    )


def gantt_figure(
    result: SimResult,
    *,
    memory: bool = False,
    comm: bool = False,
    labels: bool | None = None,
    row_label: str = "Device",
    title: bool | str = True,
    time_max: float | None = None,
    time_scale: _data.TimeScale | None = None,
    memory_height: int = 160,
) -> go.Figure:
    """The interactive Gantt (and, with ``memory``, a memory panel sharing the time axis).

    ``time_max`` and ``time_scale`` put several figures on one time axis (the report).
    """
    from plotly.subplots import make_subplots

    n = result.schedule.num_ranks
    ts = time_scale or _data.time_scale(result)
    gantt_px = round(_row_px(n) * n * _data.row_layout(result).height_scale)
    mem_px = memory_height if memory else 0
    if memory:
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                            row_heights=[gantt_px, mem_px])
        row: int | None = 1
    else:
        fig = go.Figure()
        row = None
    add_gantt_traces(fig, result, row=row, labels=labels, row_label=row_label, time_factor=ts.factor)
    if comm:
        add_comm_traces(fig, result, row=row, time_factor=ts.factor)
    if memory:
        add_memory_traces(fig, result, row=2, row_label=row_label, time_factor=ts.factor)
    span = (time_max if time_max is not None else result.makespan) * ts.factor
    fig.update_xaxes(range=[0, span], showgrid=False, zeroline=False, ticks="outside", showline=False)
    fig.update_xaxes(title_text=ts.label, row=2 if memory else None, col=1 if memory else None)
    key = _data.digit_key(result)
    notes = []
    if labels is False or (labels is None and result.schedule.num_actions > MAX_LABELLED_CELLS):
        notes.append("microbatch ids hidden at this size: hover a cell")
    elif key.by is not None:
        notes.append(f"digits: black = {key.black.split(', ', 1)[-1]}, white = {key.white.split(', ', 1)[-1]}")
    notes.append("idle time blank; drag to zoom, double-click to reset, click legend entries to hide kinds")
    fig.update_layout(
        title=dict(text=title if isinstance(title, str) else (_data.title(result) if title else ""), x=0.01,
                   font=dict(size=15)),
        barmode="overlay",
        bargap=0,
        plot_bgcolor="white",
        paper_bgcolor="white",
        font=dict(family="Helvetica, Arial, sans-serif", size=12),
        height=gantt_px + mem_px + 200 + (60 if memory else 0),
        margin=dict(l=90, r=30, t=60, b=120),
        legend=dict(orientation="h", yanchor="top", y=-60 / (gantt_px + mem_px + 60) - (0.12 if memory else 0),
                    x=0, xanchor="left", font=dict(size=12)),
        uniformtext=dict(minsize=MIN_LABEL_PX, mode="hide"),
        hoverlabel=dict(bgcolor="white"),
        annotations=[dict(text=" · ".join(notes), showarrow=False, xref="paper", yref="paper", x=0, y=1.0,
                          xanchor="left", yanchor="bottom", font=dict(size=11, color="#555"))],
    )
    return fig


def write_html(
    result: SimResult, path: str | os.PathLike[str], *, memory: bool = False, comm: bool = False
) -> Path:
    """The interactive chart as one HTML file with plotly.js embedded (works offline)."""
    fig = gantt_figure(result, memory=memory, comm=comm)
    html = fig.to_html(include_plotlyjs=True, full_html=True, config=PLOTLY_CONFIG)
    return write_atomic(path, html)
