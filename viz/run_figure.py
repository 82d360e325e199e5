"""`ppsim run --plot`: the measured step's timeline above the predicted one, on one time axis.

Takes plain bars ``(rank, start_s, end_s, computation)`` (``RunReport.measured_bars()`` / ``predicted_bars()``), so
this module needs nothing from ``ppsim.calibrate``: the CLI draws after `run` returns its report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

Bars = list[tuple[int, float, float, str]]
"""(rank, start, end, computation) per drawn bar."""


def plot_run(measured: Bars, predicted: Bars, num_ranks: int, title: str, path: str | os.PathLike[str]) -> Path:
    """Write the two panels to ``path``: png/svg/pdf with matplotlib, or self-contained interactive html."""
    target = Path(path)
    if target.suffix.lower() in (".html", ".htm"):
        from ppsim.io import write_atomic

        return write_atomic(target, _plotly_html(measured, predicted, num_ranks, title))
    import matplotlib.pyplot as plt

    from ppsim.viz.gantt import save_figure

    fig = gantt_pair_figure(measured, predicted, num_ranks, title)
    try:
        return save_figure(fig, target, dpi=150)
    finally:
        plt.close(fig)


_COLORS = {"F": "#F1B238", "B": "#7FD650", "I": "#7FD650", "W": "#77BEFA"}


def gantt_pair_figure(measured: Bars, predicted: Bars, num_ranks: int, title: str) -> Any:
    """Two Gantt panels sharing the time axis: measured (top) and predicted (bottom). Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(max(e for _, _, e, _ in measured), max(e for _, _, e, _ in predicted))
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(12, 1.2 + 0.8 * num_ranks), squeeze=True)
    for ax, rows, label in ((axes[0], measured, "measured"), (axes[1], predicted, "predicted")):
        for rank, start, end, name in rows:
            kind = "".join(ch for ch in name if ch.isalpha())
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.8, color=_COLORS.get(kind, "#cccccc"),
                    edgecolor="black", linewidth=0.4)
            digits = name[len(name.rstrip("0123456789")):]
            if (end - start) / span > 0.012:
                ax.text((start + end) / 2 * 1e3, rank, digits, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
        ax.set_ylim(num_ranks - 0.5, -0.5)
        ax.set_ylabel(label)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("time (ms)")
    axes[1].set_xlim(0, span * 1e3)
    handles = [Patch(facecolor=_COLORS[k], edgecolor="black", label=lbl)
               for k, lbl in (("F", "forward"), ("B", "backward / for input"), ("W", "backward for weights"))]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def _plotly_html(measured: Bars, predicted: Bars, num_ranks: int, title: str) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("measured", "predicted"),
                        vertical_spacing=0.08)
    for row, rows in ((1, measured), (2, predicted)):
        for kind in ("F", "B", "I", "W"):
            sel = [r for r in rows if "".join(ch for ch in r[3] if ch.isalpha()) == kind]
            if not sel:
                continue
            fig.add_trace(
                go.Bar(
                    x=[(e - s) * 1e3 for _, s, e, _ in sel], base=[s * 1e3 for _, s, _, _ in sel],
                    y=[f"rank {r}" for r, _, _, _ in sel], orientation="h", marker_color=_COLORS[kind],
                    marker_line_color="black", marker_line_width=0.5,
                    name=f"{kind} ({'measured' if row == 1 else 'predicted'})", text=[n for _, _, _, n in sel],
                    hovertemplate="%{text}: %{base:.3f} ms + %{x:.3f} ms<extra></extra>",
                ),
                row=row, col=1,
            )
        fig.update_yaxes(autorange="reversed", categoryorder="array",
                         categoryarray=[f"rank {r}" for r in range(num_ranks)], row=row, col=1)
    fig.update_xaxes(title_text="time (ms)", row=2, col=1)
    fig.update_layout(title=title, barmode="overlay", height=250 + 90 * num_ranks, bargap=0.15)
    return fig.to_html(include_plotlyjs=True, full_html=True)
