"""The typer application object every command module registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ppsim",
    help="Generate, simulate, draw, calibrate and execute pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
