"""The typer application object every command module registers on."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    name="ppsim",
    help="Generate, simulate, draw, calibrate and execute pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        import ppsim

        typer.echo(f"ppsim {ppsim.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the ppsim version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    """Generate, simulate, draw, calibrate and execute pipeline-parallel training schedules."""
