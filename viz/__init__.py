"""Figures: matplotlib Gantt charts, plotly interactive HTML, the comparison report.

Importing this package is cheap: matplotlib is imported by :mod:`ppsim.viz.gantt`, plotly by
:mod:`ppsim.viz.interactive` and :mod:`ppsim.viz.report`, each only when used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.result import SimResult

STATIC_FORMATS = (".png", ".svg", ".pdf")
HTML_FORMATS = (".html", ".htm")
PLOT_FORMATS = STATIC_FORMATS + HTML_FORMATS

__all__ = ["PLOT_FORMATS", "plot_gantt", "plot_memory", "plot_to_file", "gantt_figure", "write_html", "write_report"]


def plot_to_file(
    result: SimResult, path: str | os.PathLike[str], *, dpi: int = 200, memory: bool = False, comm: bool = False
) -> Path:
    """Draw ``result`` to ``path``: png/svg/pdf with matplotlib, html (interactive, offline) with plotly."""
    target = Path(path)
    ext = target.suffix.lower()
    if ext in HTML_FORMATS:
        from ppsim.viz.interactive import write_html

        return write_html(result, target, memory=memory, comm=comm)
    if ext in STATIC_FORMATS:
        from ppsim.viz.gantt import bounded_dpi, plot_gantt, save_figure

        fig = plot_gantt(result, memory=memory, comm=comm)
        return save_figure(fig, target, dpi=bounded_dpi(fig, dpi))
    raise PPSimError(
        f"-o {target}: unknown extension {target.suffix or '(none)'!r}; use one of {', '.join(PLOT_FORMATS)}"
    )


def __getattr__(name: str) -> Any:
    if name in ("plot_gantt", "plot_memory", "save_figure"):
        from ppsim.viz import gantt

        return getattr(gantt, name)
    if name in ("gantt_figure", "write_html"):
        from ppsim.viz import interactive

        return getattr(interactive, name)
    if name == "write_report":
        from ppsim.viz import report

        return report.write_report
    raise AttributeError(f"module 'ppsim.viz' has no attribute {name!r}")
