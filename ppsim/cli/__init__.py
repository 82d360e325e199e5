"""The `ppsim` command line (typer). Commands and options follow ../shared/cli-contract.md.

One module per command group registers its commands on the one ``app`` (``_app.py``): ``schedules`` (list, show,
validate, export), ``simulation`` (simulate, plot, report), ``search`` (search), ``calibrate`` and ``run``
(torch imported inside them). Options used by several
commands are declared once in ``options.py``. The CLI is the only layer that may import every other one.

User mistakes (:class:`ppsim.errors.PPSimError`, missing or unwritable files) print one line on stderr and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import copy
import os
import sys

import typer

from ppsim.cli import calibrate, plan, run, schedules, search, simulation  # noqa: F401  (importing registers the commands)
from ppsim.cli._app import app
from ppsim.cli.common import os_error_line
from ppsim.errors import PPSimError
from ppsim.io import check_writable, fmt_bytes, parse_bytes

__all__ = ["app", "main", "check_writable", "fmt_bytes", "parse_bytes"]


def main() -> None:
    """Console entry point: parse errors, OS errors, an unencodable terminal and Ctrl-C each become one line."""
    _tolerate_any_encoding()
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    try:
        code = _app_for(sys.argv)(standalone_mode=False)
    except typer.TyperException as exc:  # bad option values, unknown commands
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = bad_value_line(exc, sys.argv[1:])
        if message is None:
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        typer.echo(f"Error: {message}{where}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("Interrupted.", err=True)
        sys.exit(130)
    except BrokenPipeError:  # `ppsim list | head`: the reader left; nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)
    except OSError as exc:
        if exc.filename is None:
            raise
        typer.echo(f"Error: {os_error_line(exc)}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


_WANTED = {"int_parsing": "not a whole number; give an integer such as 3",
           "int_from_float": "not a whole number; give an integer such as 3",
           "float_parsing": "not a number; give a number such as 10",
           "finite_number": "not a finite number; give a number such as 10",
           "bool_parsing": "not true or false"}


def bad_value_line(exc: BaseException, argv: list[str]) -> str | None:
    """One line naming the option, the value given and the rule for a value typer could not convert (``--seed
    1.5``), instead of typer's generic "Input should be a valid integer"; None for any other error."""
    param = getattr(exc, "param", None)
    cause = exc.__cause__
    errors = getattr(cause, "errors", None)
    if param is None or not callable(errors):
        return None
    try:
        first = errors()[0]
    except (IndexError, TypeError):
        return None
    opts = list(getattr(param, "opts", None) or [getattr(param, "name", "?")])
    given = [o for o in opts if o in argv or any(a.startswith(o + "=") for a in argv)]
    option = (given or opts)[0]
    value = first.get("input")
    shown = repr(value) if isinstance(value, str) and len(value) <= 40 else repr(str(value)[:37] + "...")
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, PPSimError):
        return f"{option} {inner}"
    if first.get("type") in _WANTED:
        return f"{option} {shown}: {_WANTED[first['type']]}"
    rule = str(first.get("msg", "")).replace("Input should be", "must be").replace("Value error, ", "")
    return f"{option} {shown}: {rule}"


def _app_for(argv: list[str]) -> typer.Typer:
    """The app with only the command ``argv`` names (none for ``--version``): typer reads every registered command's
    options when it builds the app, which costs more than a short command itself. Help, an unknown name or no
    name gets the whole app, so the listing and the "no such command" message are unchanged."""
    if not isinstance(app, typer.Typer):  # a stand-in for the app (tests replace it)
        return app
    name = argv[1] if len(argv) > 1 else None
    chosen = [c for c in app.registered_commands if c.name == name]
    if not chosen and name != "--version":
        return app
    one = copy.copy(app)  # the same settings and root callback (--version); its own command list
    one.registered_commands = chosen
    return one


def _tolerate_any_encoding() -> None:
    """Characters the terminal's encoding lacks (PYTHONIOENCODING=ascii) print as '?' instead of crashing."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass

