"""Commands that need torch (`ppsim calibrate`, `ppsim run`): defined in ppsim.calibrate, torch imported inside.

`run --plot` draws with ``ppsim.viz.run_figure`` after the run returns (calibrate/ does not import viz)."""

from __future__ import annotations

from ppsim.calibrate.commands import register
from ppsim.cli._app import app
from ppsim.cli.common import user_errors
from ppsim.viz.run_figure import plot_run

register(app, wrap=user_errors, plot_run=plot_run)
