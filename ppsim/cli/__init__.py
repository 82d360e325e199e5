"""The `ppsim` command line (typer). Commands and options follow ../shared/cli-contract.md.

One module per command group registers its commands on the one ``app`` (``_app.py``): ``schedules`` (list, show,
validate, export), ``simulation`` (simulate, plot, report), ``search`` (search), ``calibrate`` and ``run``
(torch imported inside them). Options used by several
commands are declared once in ``options.py``. The CLI is the only layer that may import every other one.

Start-up: importing this package loads nothing else; ``app`` (and with it typer and every command module) loads on
first use. ``ppsim --version`` and ``ppsim list [--json]`` never load it (:data:`_SHORT`: the same bytes as their
typer commands, in a third of the time).

User mistakes (:class:`ppsim.errors.PPSimError`, missing or unwritable files) print one line on stderr and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    from ppsim.cli._app import app
    from ppsim.io import check_writable, fmt_bytes, parse_bytes

__all__ = ["app", "main", "check_writable", "fmt_bytes", "parse_bytes"]

_LAZY = {"check_writable": "ppsim.io", "fmt_bytes": "ppsim.io", "parse_bytes": "ppsim.io"}


def __getattr__(name: str) -> Any:
    """``app`` (every command registered on it) and the ``ppsim.io`` names load on first use: the short commands
    (``--version``, ``list``) run without typer (see :func:`main`)."""
    if name == "app":
        import importlib

        for module in ("calibrate", "plan", "run", "schedules", "search", "simulation"):  # importing registers them
            importlib.import_module(f"ppsim.cli.{module}")
        importlib.import_module("ppsim.cli.collective")  # `ppsim collective`
        from ppsim.cli._app import app

        globals()["app"] = app
        return app
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ppsim.cli' has no attribute {name!r}")


_STARTED: list[float] = []
"""``time.monotonic()`` when this process started (set by :func:`main`): commands with a time limit count from it."""


def process_started() -> float:
    """``time.monotonic()`` at which this process started (Linux: its start time in ``/proc/self/stat`` against the
    uptime, so the interpreter's start and the imports count), else now."""
    import time

    now = time.monotonic()
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        ago = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(0.0, ago), 3600.0)


def command_started() -> float:
    """When the command began: the process's start under :func:`main`, else (the command called in-process, as
    typer's test runner does) now."""
    import time

    return _STARTED[0] if _STARTED else time.monotonic()


_MAIN_CALLS = [0]
"""How many times :func:`main` ran in this process: only the first counts from the process's start (a test runner's
process calls it again and again)."""


def main() -> None:
    """Console entry point: parse errors, OS errors, an unencodable terminal and Ctrl-C each become one line."""
    import time

    _STARTED[:] = [process_started() if _MAIN_CALLS[0] == 0 else time.monotonic()]
    _MAIN_CALLS[0] += 1
    try:
        _main()
    finally:
        _STARTED.clear()  # a command called in-process afterwards counts from its own start


def _main() -> None:
    _tolerate_any_encoding()
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    short = _SHORT.get(tuple(sys.argv[1:]))
    try:
        code = _run_short(short) if short is not None else _run_app(sys.argv)
    except KeyboardInterrupt:
        _interrupted()
    except BrokenPipeError:  # `ppsim list | head`: the reader left; nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)
    except OSError as exc:
        if exc.filename is None:
            raise
        import typer

        from ppsim.cli.common import os_error_line

        typer.echo(f"Error: {os_error_line(exc)}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def _run_app(argv: list[str]) -> Any:
    """Run the typer app on ``argv`` (its own errors become one line); what the command returned."""
    import typer

    restore = _one_blas_thread(argv)
    try:
        return _app_for(argv)(standalone_mode=False)
    except typer.TyperException as exc:  # bad option values, unknown commands
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = bad_value_line(exc, argv[1:])
        if message is None:
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        typer.echo(f"Error: {message}{where}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        _interrupted()
    finally:
        restore()


_NO_LINEAR_ALGEBRA = frozenset({"simulate", "show", "validate", "export", "plot", "report", "search", "plan"})
"""Commands whose numpy work is element-wise and that start no worker processes (``run`` and ``calibrate`` do)."""


def _one_blas_thread(argv: list[str]) -> Callable[[], None]:
    """For a command in :data:`_NO_LINEAR_ALGEBRA`, numpy's OpenBLAS starts one thread instead of one per core
    (unless ``OPENBLAS_NUM_THREADS`` is set): starting the pool costs about 40 ms of CPU per command on two cores,
    more on big hosts, and these commands never multiply matrices. Returns what puts the environment back."""
    key = "OPENBLAS_NUM_THREADS"
    if len(argv) < 2 or argv[1] not in _NO_LINEAR_ALGEBRA or key in os.environ:
        return lambda: None
    os.environ[key] = "1"
    return lambda: os.environ.pop(key, None)  # type: ignore[return-value]


def _interrupted() -> None:
    sys.stderr.write("Interrupted.\n")
    sys.stderr.flush()
    sys.exit(130)


def _run_short(command: Callable[[], Any]) -> Any:
    """A short command with the cyclic garbage collector paused: it makes no cycles, and the collector's passes
    over the modules it imports (rich's among them) cost about a tenth of its time."""
    import gc

    collecting = gc.isenabled()
    gc.disable()
    try:
        return command()
    finally:
        if collecting:
            gc.enable()


def _print_version() -> None:
    import ppsim

    sys.stdout.write(f"ppsim {ppsim.__version__}\n")
    sys.stdout.flush()


def _print_schedules(*, json_out: bool) -> None:
    from ppsim.cli.output import print_schedules

    print_schedules(json_out=json_out)


_SHORT: dict[tuple[str, ...], Callable[[], Any]] = {
    ("--version",): _print_version,
    ("list",): functools.partial(_print_schedules, json_out=False),
    ("list", "--json"): functools.partial(_print_schedules, json_out=True),
}
"""Command lines run without building the typer app (typer and its options cost more than these commands): each
prints exactly what its typer command prints (tests/cli/test_startup.py compares them byte for byte)."""


_WANTED = {"int_parsing": "not a whole number; give an integer such as 3",
           "int_from_float": "not a whole number; give an integer such as 3",
           "float_parsing": "not a number; give a number such as 10",
           "finite_number": "not a finite number; give a number such as 10",
           "bool_parsing": "not true or false"}


def bad_value_line(exc: BaseException, argv: list[str]) -> str | None:
    """One line naming the option, the value given and the rule for a value typer could not convert (``--seed
    1.5``), instead of typer's generic "Input should be a valid integer"; None for any other error."""
    from ppsim.errors import PPSimError

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
    import typer

    app = globals().get("app") or __getattr__("app")
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

