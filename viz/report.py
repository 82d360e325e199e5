"""The comparison report: one self-contained HTML page (plotly.js embedded once, works offline).

Sections: a summary table ranked by makespan (schedules that cannot run the configuration get a row saying why),
one interactive Gantt per schedule on a shared time axis with its memory panel, bubble and peak memory per rank,
the costs used and the versions that produced the page.
"""

from __future__ import annotations

import html
import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.io import fmt_bytes, write_atomic
from ppsim.viz import _data

if TYPE_CHECKING:
    from ppsim.compare import Comparison
    from ppsim.costs import CostSpec, StageCosts
    from ppsim.result import SimResult

Entry = tuple[str, "SimResult | str"]

_CSS = """
body { font-family: Helvetica, Arial, "Liberation Sans", sans-serif; margin: 24px 32px; color: #111; }
h1 { font-size: 22px; margin-bottom: 4px; }
h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 2px; }
p.meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; vertical-align: top; }
th { background: #f3f3f3; }
td.name, th.name, td.why, td.key { text-align: left; }
td.why { color: #8a1f11; }
td.why div { max-width: 75ch; }
tr.best td { background: #f1fbe9; }
span.bad { color: #c62828; font-weight: bold; }
span.small { color: #666; font-size: 11px; display: block; }
.chart { margin-bottom: 8px; }
pre.launch { white-space: pre-wrap; background: #f6f6f6; padding: 8px; }
pre.launch span { white-space: nowrap; }
"""


def _versions() -> dict[str, str]:
    """Versions that produced the page; torch through package metadata only (never imported)."""
    import plotly

    import ppsim

    def dist(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "ppsim": ppsim.__version__,
        "torch": dist("torch"),
        "python": platform.python_version(),
        "plotly": plotly.__version__,
    }


def _bytes(n: float | None) -> str:
    return "–" if n is None else fmt_bytes(n)


def _per_rank(values: Sequence[Any]) -> str:
    return " ".join(str(v) for v in values)


def summary_rows(entries: Sequence[Entry], memory_cap_bytes: int | None) -> list[dict[str, str]]:
    """Table rows: runnable schedules ranked by makespan, then the ones that cannot run, with the reason."""
    ok = ranked(entries)
    rows: list[dict[str, str]] = []
    best = ok[0][1].makespan if ok else None
    for i, (name, r) in enumerate(ok, 1):
        acts = [p.peak_activations for p in r.per_rank]
        peak_bytes = [p.peak_memory_bytes for p in r.per_rank]
        if memory_cap_bytes is None:
            cap = "no cap given"
        elif all(b is None for b in peak_bytes):
            cap = "needs a profile"
        else:
            over = [p.rank for p in r.per_rank if p.over_memory_cap]
            cap = (f'<span class="bad">{len(over)} rank(s): {_per_rank(over)}</span>'
                   f"<span class='small'>cap {_bytes(memory_cap_bytes)}</span>" if over else "none")
        rel = f"{r.makespan / best:.2f}×" if best else ""
        rows.append({
            "#": str(i),
            "schedule": html.escape(name) + (f"<span class='small'>{html.escape(_data.recompute_note(r)[2:])}"
                                             "</span>" if r.recompute else ""),
            "makespan": f"{_data.fmt_time(r, r.makespan)}<span class='small'>{rel} best</span>",
            "bubble": f"{r.bubble_ratio:.1%}",
            "throughput": f"{r.throughput:.4g} microbatches/{'s' if r.unit == 's' else 'unit'}",
            "peak activations": f"{max(acts)}<span class='small'>per rank: {_per_rank(acts)}</span>",
            "peak memory": (
                "– <span class='small'>needs a profile</span>" if all(b is None for b in peak_bytes) else
                f"{_bytes(max(b or 0 for b in peak_bytes))}"
                f"<span class='small'>per rank: {', '.join(_bytes(b) for b in peak_bytes)}</span>"
            ),
            "over memory cap": cap,
        })
    for name, why in entries:
        if isinstance(why, str):
            rows.append({"#": "–", "schedule": html.escape(name), "why": html.escape(why)})
    return rows


def _table(rows: list[dict[str, str]]) -> str:
    cols = ["#", "schedule", "makespan", "bubble", "throughput", "peak activations", "peak memory", "over memory cap"]
    head = "".join(f'<th class="{"name" if c == "schedule" else ""}">{c}</th>' for c in cols)
    body = []
    for i, row in enumerate(rows):
        if "why" in row:
            body.append(
                f'<tr class="failed"><td>{row["#"]}</td><td class="name">{row["schedule"]}</td>'
                f'<td class="why" colspan="{len(cols) - 2}">'
                f'<div>cannot run this configuration: {row["why"]}</div></td></tr>'
            )
            continue
        cls = ' class="best"' if i == 0 else ""
        cells = "".join(f'<td class="{"name" if c == "schedule" else ""}">{row[c]}</td>' for c in cols)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f'<table id="summary"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _costs_table(costs: CostSpec | StageCosts) -> str:
    rows = []
    for key, value in costs.to_dict().items():
        if isinstance(value, list):
            text = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in value)
        elif isinstance(value, dict):
            text = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
        elif isinstance(value, float):
            text = f"{value:.6g}"
        else:
            text = str(value)
        rows.append(f'<tr><td class="key">{html.escape(key)}</td><td class="key">{html.escape(text)}</td></tr>')
    return f'<table id="costs"><tbody>{"".join(rows)}</tbody></table>'


def ranked(entries: Sequence[Entry]) -> list[tuple[str, SimResult]]:
    """The schedules that ran, fastest first (ranked by :func:`ppsim.compare.rank`)."""
    from ppsim.compare import rank

    ok = {id(r): n for n, r in entries if not isinstance(r, str)}
    results = [r for _, r in entries if not isinstance(r, str)]
    return [(ok[id(r)], r) for r in rank(results)]


def gantt_figures(results: Sequence[tuple[str, SimResult]]) -> list[Any]:
    """One interactive Gantt with its memory panel per schedule, all on one time axis (the longest makespan)."""
    from ppsim.viz.interactive import gantt_figure

    if not results:
        return []
    span = max(r.makespan for _, r in results)
    ts = _data.time_scale(results[0][1], span=span)
    return [gantt_figure(r, memory=True, time_max=span, time_scale=ts, memory_height=120) for _, r in results]


def per_rank_figures(results: Sequence[tuple[str, SimResult]]) -> list[Any]:
    """Grouped bars per rank across schedules: bubble ratio, and peak memory (bytes, or activations)."""
    import plotly.graph_objects as go

    bubble = go.Figure()
    memory = go.Figure()
    with_bytes = any(p.peak_memory_bytes is not None for _, r in results for p in r.per_rank)
    for name, r in results:
        ranks = [p.rank for p in r.per_rank]
        bubble.add_trace(go.Bar(x=ranks, y=[p.bubble_ratio for p in r.per_rank], name=name,
                                hovertemplate=f"{name}<br>rank %{{x}}: bubble %{{y:.1%}}<extra></extra>"))
        if with_bytes:
            y = [(p.peak_memory_bytes or 0) / 2**30 for p in r.per_rank]
            label = "peak memory (GiB)"
        else:
            y = [p.peak_activations for p in r.per_rank]
            label = "peak activations"
        memory.add_trace(go.Bar(x=ranks, y=y, name=name,
                                hovertemplate=f"{name}<br>rank %{{x}}: {label} %{{y:.4g}}<extra></extra>"))
    common = dict(barmode="group", height=320, plot_bgcolor="white", margin=dict(l=70, r=20, t=40, b=50),
                  font=dict(family="Helvetica, Arial, sans-serif", size=12), legend=dict(orientation="h", y=-0.2))
    bubble.update_layout(title="Bubble (idle share) per rank", yaxis=dict(tickformat=".0%", title="bubble",
                         gridcolor="#eee", rangemode="tozero"), xaxis=dict(title="rank", dtick=1), **common)
    memory.update_layout(title=f"{label[0].upper()}{label[1:]} per rank",
                         yaxis=dict(title=label, gridcolor="#eee", rangemode="tozero"),
                         xaxis=dict(title="rank", dtick=1), **common)
    return [bubble, memory]


def _div(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    from ppsim.viz.interactive import PLOTLY_CONFIG

    return '<div class="chart">' + pio.to_html(fig, full_html=False, include_plotlyjs=False,
                                               config=PLOTLY_CONFIG, div_id=div_id) + "</div>"


def render_report(
    entries: Sequence[Entry], *, costs: CostSpec | StageCosts, memory_cap_bytes: int | None = None,
    scope: str | None = None,
) -> str:
    """The report page as one HTML string; ``scope`` is the line saying how the costs were read."""
    from plotly.offline import get_plotlyjs

    results = ranked(entries)
    names = ", ".join(n for n, _ in entries)
    first = results[0][1] if results else None
    if first is not None:
        config = (f"{first.schedule.num_ranks} ranks, {first.schedule.num_microbatches} microbatches")
    else:
        config = "no schedule could run this configuration"
    versions = _versions()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ppsim report: {html.escape(names)}</title>",
        f"<style>{_CSS}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        "</head><body>",
        "<h1>Pipeline schedule report</h1>",
        f'<p class="meta">{html.escape(names)} — {html.escape(config)}; costs: {html.escape(costs.source)} '
        f"({html.escape(costs.unit)}). Generated {stamp} by ppsim {html.escape(versions['ppsim'])}.</p>",
        "<h2>Ranking</h2>",
        _table(summary_rows(entries, memory_cap_bytes)),
    ]
    if memory_cap_bytes is not None:
        parts.append(f'<p class="meta">memory cap: {_bytes(memory_cap_bytes)} per rank</p>')
    if results:
        parts.append("<h2>Gantt charts and memory over time (one time axis)</h2>")
        for i, ((name, _), fig) in enumerate(zip(results, gantt_figures(results))):
            note = _data.recompute_note(results[i][1])
            parts.append(f"<h3>{html.escape(name)}{html.escape(note)}{' (hatched)' if note else ''}</h3>")
            parts.append(_div(fig, f"gantt-{i}"))
        parts.append("<h2>Bubble and peak memory per rank</h2>")
        for j, fig in enumerate(per_rank_figures(results)):
            parts.append(_div(fig, f"per-rank-{j}"))
    failed = [(n, why) for n, why in entries if isinstance(why, str)]
    if failed:
        parts.append("<h2>Not drawn</h2><ul>")
        parts.extend(f"<li><b>{html.escape(n)}</b>: {html.escape(str(why))}</li>" for n, why in failed)
        parts.append("</ul>")
    parts.append("<h2>Costs used</h2>")
    if scope is not None:
        parts.append(f'<p class="meta" id="cost-scope">{html.escape(scope)}</p>')
    parts.append(_costs_table(costs))
    parts.append("<h2>Versions</h2>")
    parts.append('<table id="versions"><tbody>' + "".join(
        f'<tr><td class="key">{k}</td><td class="key">{html.escape(v)}</td></tr>' for k, v in versions.items()
    ) + "</tbody></table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    entries: Comparison | Sequence[Entry],
    path: str | os.PathLike[str],
    *,
    costs: CostSpec | StageCosts | None = None,
    memory_cap_bytes: int | None = None,
) -> Path:
    """Write the report page for a :class:`ppsim.compare.Comparison` (its costs and scope are stated on the page),
    or for ``(name, result or why)`` entries, where a string is the reason a schedule could not be built."""
    from ppsim.compare import Comparison

    scope = None
    if isinstance(entries, Comparison):
        costs, scope, entries = entries.costs, entries.scope_text, entries.entries()
    if costs is None:
        raise TypeError("write_report needs costs= with a list of entries")
    page = render_report(entries, costs=costs, memory_cap_bytes=memory_cap_bytes, scope=scope)
    return write_atomic(Path(path), page)
