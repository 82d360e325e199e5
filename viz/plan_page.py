"""`ppsim plan -o plan.html`: one offline page with the time-memory frontier, the best candidate's Gantt chart and
memory per rank, and why the runners-up lost. Built with the report's machinery (:mod:`ppsim.viz.report`)."""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.io import write_atomic
from ppsim.job.memory import GIB, PARTS
from ppsim.viz.report import _CSS, _div, gantt_figures

if TYPE_CHECKING:
    from ppsim.plan import Judged, Plan


def _step(j: Judged) -> float | None:
    return j.step_s if j.step_s is not None else j.relative_step


AXIS_TITLES = {"s": "step (s)", "unit": "relative step (unit costs, not seconds)"}
"""Each frontier panel's step axis: seconds (a profile timed them) or unit costs, never both on one axis."""


def frontier_figure(result: Plan, unit: str | None = None) -> Any:
    """The candidates timed in ``unit`` (``"s"`` or ``"unit"``; default: the best's) as points (peak GiB, step),
    their frontier joined by a line, on an axis of that unit only."""
    import plotly.graph_objects as go

    from ppsim.plan import describe

    unit = unit or (result.best.step_unit if result.best is not None else None) or "unit"
    fig = go.Figure()
    points = list(result.ranked_in(unit))
    fig.add_trace(go.Scatter(x=[j.peak_bytes / GIB for j in points], y=[_step(j) for j in points], mode="markers",
                             name="fits", text=[describe(j.candidate) for j in points], marker={"color": "#9ab"}))
    front = result.frontier(unit)
    fig.add_trace(go.Scatter(x=[j.peak_bytes / GIB for j in front], y=[_step(j) for j in front],
                             mode="lines+markers", name="frontier", text=[describe(j.candidate) for j in front]))
    fig.update_layout(xaxis_title="peak memory of the fullest rank (GiB)", yaxis_title=AXIS_TITLES[unit], height=420)
    return fig


def frontier_figures(result: Plan) -> list[tuple[str, Any]]:
    """One frontier panel per step unit among the ranked (the best's first): ``(unit, figure)``."""
    return [(unit, frontier_figure(result, unit)) for unit in result.units]


def _frontier_section(result: Plan) -> str:
    panels = frontier_figures(result)
    out = []
    for n, (unit, fig) in enumerate(panels):
        if len(panels) > 1:
            out.append("<h3>Timed in seconds (a profile covers them)</h3>" if unit == "s" else
                       "<h3>Ranked by unit costs (no profile covers them; not comparable with seconds)</h3>")
        out.append(_div(fig, "frontier" if n == 0 else f"frontier-{unit}"))
    return "\n".join(out)


def memory_figure(best: Judged) -> Any:
    """The best candidate's memory per PP rank at its high point, stacked by part."""
    import plotly.graph_objects as go

    fig = go.Figure()
    ranks = [f"rank {m.rank}" for m in best.memory]
    for part in PARTS:
        fig.add_trace(go.Bar(x=ranks, y=[m.parts[part] / GIB for m in best.memory], name=part))
    if best.memory and best.memory[0].cap_bytes is not None:
        fig.add_hline(y=best.memory[0].cap_bytes / GIB, line_dash="dash", annotation_text="cap")
    fig.update_layout(barmode="stack", yaxis_title="GiB", height=380)
    return fig


def _lost_table(rows: list[tuple[str, str]]) -> str:
    if not rows:
        return "<p>none</p>"
    body = "".join(f'<tr><td class="name">{html.escape(c)}</td><td>{html.escape(w)}</td></tr>' for c, w in rows)
    head = "<thead><tr><th>candidate</th><th>why it lost</th></tr></thead>"
    return f'<table id="runners-up">{head}<tbody>{body}</tbody></table>'


def _why_lost(result: Plan) -> list[tuple[str, str]]:
    from ppsim.plan import describe

    best = result.best
    rows = []
    for j in result.ranked[1:result.request.top]:
        if best is None or j.step_unit != best.step_unit:  # seconds and unit costs are never compared
            rows.append((describe(j.candidate), "not timed in seconds: no profile covers it (ranked by unit costs "
                         "among its kind only)"))
            continue
        slower = (_step(j) or 0) / (_step(best) or 1) - 1
        rows.append((describe(j.candidate), f"{100 * slower:.1f} % slower"))
    for j in [j for j in result.judged if j.memory and not j.fits][:result.request.top]:
        rows.append((describe(j.candidate), j.reason))
    return rows


def render_plan_page(result: Plan, *, job: str) -> str:
    from plotly.offline import get_plotlyjs

    from ppsim.plan import describe

    best = result.best
    assert best is not None and result.best_timeline is not None  # the caller writes a page only for a plan with a best
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>ppsim plan: {html.escape(job)}</title>", f"<style>{_CSS}</style>",
             f'<script type="text/javascript">{get_plotlyjs()}</script>', "</head><body>",
             f"<h1>Plan for {html.escape(job)} on {result.request.num_gpus} GPUs</h1>",
             f'<p class="meta">cap {result.request.cap_bytes / GIB:.2f} GiB per device; global batch '
             f"{result.global_batch}; {html.escape(result.counts())}.</p>",
             f"<h2>Best: {html.escape(describe(best.candidate))}</h2>",
             # wrapped on screen between overrides (each kept on one line), copied whole: a soft wrap adds nothing
             '<pre class="launch">' + " ".join(f"<span>{html.escape(o)}</span>" for o in best.overrides) + "</pre>",
             "<h2>Time-memory frontier</h2>", _frontier_section(result),
             "<h2>The best candidate's order</h2>",
             _div(gantt_figures([(best.candidate.schedule, result.best_timeline)])[0], "gantt-best"),
             "<h2>The best candidate's memory per rank</h2>", _div(memory_figure(best), "memory-best"),
             "<h2>Why the runners-up lost</h2>", _lost_table(_why_lost(result)),
             "</body></html>"]
    return "\n".join(parts)


def write_plan_page(result: Plan, path: str | os.PathLike[str], *, job: str) -> Path:
    return write_atomic(Path(path), render_plan_page(result, job=job))
