"""The `ppsim` command line (typer). Commands and options follow ../shared/cli-contract.md.

One module per command group registers its commands on the one ``app`` (``_app.py``): ``schedules`` (list, show,
validate, export), ``simulation`` (simulate, plot, report), ``torch_cmds`` (calibrate, run). Options used by several
commands are declared once in ``options.py``. The CLI is the only layer that may import every other one.

User mistakes (:class:`ppsim.errors.PPSimError`, missing or unwritable files) print one line on stderr and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

from ppsim.cli import schedules, simulation, torch_cmds  # noqa: F401  (importing registers the commands)
from ppsim.cli._app import app
from ppsim.io import check_writable, fmt_bytes, parse_bytes

__all__ = ["app", "main", "check_writable", "fmt_bytes", "parse_bytes"]


def main() -> None:
    """Console entry point: typer's own parse errors become one line too (exit 2)."""
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # bad option values, unknown commands
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        typer.echo(f"Error: {message}{where}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
