"""Start-up: the short commands load only what they use (no numpy, pandas, rich tables, search machinery, frames)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HEAVY = ("numpy", "pandas", "rich.table", "ppsim.result", "ppsim.simulator", "ppsim.search.common",
         "ppsim.search.driver", "ppsim.search.cpsat", "ortools", "torch", "matplotlib", "pydantic", "ppsim.job",
         "typer")


def _loaded_after(argv: list[str], *, run: str = "main()") -> list[str]:
    """The heavy modules loaded by importing ppsim.cli and running ``ppsim ARGV`` (in a fresh interpreter) with
    ``ppsim.cli.RUN``: ``main()``, or ``_run_app(sys.argv)`` for the typer path the short commands skip."""
    code = (
        "import io, sys, contextlib\n"
        f"sys.argv = ['ppsim', *{argv!r}]\n"
        "import ppsim.cli\n"
        "if len(sys.argv) > 1:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        f"            ppsim.cli.{run}\n"
        "        except SystemExit:\n"
        "            pass\n"
        f"print(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_cli_loads_nothing_heavy() -> None:
    assert _loaded_after([]) == []


@pytest.mark.parametrize("argv, expected", [
    (["--version"], []),
    (["show", "-s", "1F1B", "-r", "2", "-m", "2"], ["typer"]),  # its plain values are converted without pydantic
])
def test_short_commands_load_only_what_they_use(argv: list[str], expected: list[str]) -> None:
    assert _loaded_after(argv) == expected


def test_simulate_converts_its_values_without_pydantic() -> None:
    loaded = _loaded_after(["simulate", "-s", "Interleaved1F1B", "-r", "4", "-m", "8", "-v", "2", "--json"])
    assert "pydantic" not in loaded and "numpy" in loaded


def test_list_loads_only_the_table_it_prints() -> None:
    assert _loaded_after(["list"]) == ["rich.table"]


def test_an_unset_help_option_is_not_converted_by_pydantic() -> None:
    # typer converts every option's value, --help's unset one too, through a pydantic adapter (pydantic: ~60 ms)
    assert _loaded_after(["list", "--json"], run="_run_app(sys.argv)") == ["typer"]


def test_list_json_loads_nothing_heavy() -> None:
    assert _loaded_after(["list", "--json"]) == []


def _ppsim(code: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    import os

    return subprocess.run([sys.executable, "-c", f"import sys; sys.argv = ['ppsim', *{argv!r}]; {code}"],
                          capture_output=True, env={**os.environ, **env})


@pytest.mark.parametrize("argv", [["--version"], ["list"], ["list", "--json"]])
@pytest.mark.parametrize("env", [{}, {"COLUMNS": "57"}, {"PYTHONIOENCODING": "ascii"}, {"FORCE_COLOR": "1"}],
                         ids=["plain", "narrow", "ascii", "color"])
def test_a_short_command_prints_what_its_typer_command_prints(argv: list[str], env: dict[str, str]) -> None:
    """`main()` runs ``--version`` and ``list`` without typer; the bytes, the stderr and the exit code are typer's."""
    fast = _ppsim("from ppsim.cli import main; main()", argv, env)
    typer_path = _ppsim("from ppsim.cli import _run_app; sys.exit(_run_app(sys.argv) or 0)", argv, env)
    assert fast.returncode == typer_path.returncode == 0
    assert fast.stdout == typer_path.stdout and fast.stderr == typer_path.stderr
    assert fast.stdout.strip()


@pytest.mark.parametrize("argv", [["--help"], ["list", "--help"], ["show", "--help"]])
def test_help_given_still_prints_the_help(argv: list[str]) -> None:
    from typer.testing import CliRunner

    from ppsim.cli import app

    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0 and "Usage" in result.output


def test_the_library_names_load_on_first_use() -> None:
    import ppsim
    from ppsim.simulator import simulate

    assert ppsim.simulate is simulate  # the function; its module is ppsim.simulator
    assert "load_costs" in ppsim.__all__ and callable(ppsim.load_costs)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ppsim.nope  # noqa: B018


def test_a_command_run_alone_behaves_as_in_the_whole_app() -> None:
    from typer.testing import CliRunner

    from ppsim.cli import _app_for, app

    whole = CliRunner().invoke(app, ["list", "--json"])
    alone = CliRunner().invoke(_app_for(["ppsim", "list"]), ["list", "--json"])
    assert alone.exit_code == whole.exit_code == 0 and alone.output == whole.output
    assert _app_for(["ppsim", "--help"]) is app and _app_for(["ppsim", "lis"]) is app
    assert [c.name for c in _app_for(["ppsim", "--version"]).registered_commands] == []


def _options() -> list[tuple[Any, Any]]:
    """(context, option) for every option of every command."""
    import typer
    from typer.core import _click

    from ppsim.cli import app

    group = typer.main.get_command(app)
    pairs = []
    for command in group.commands.values():
        ctx = _click.Context(command)
        pairs += [(ctx, p) for p in command.params if getattr(p, "type_descriptor", None) is not None]
    return pairs


SAMPLES = ["0", "7", "0064", "20", "19", "1200", "1201", "123456789012345678", "1234567890123456789", "-3", "1.5",
           " 5", "5 ", "x", "", "٣", "²", "1F1B", ("1F1B", "GPipe"), ["a"], 3, 0, True, 2.5]


def test_a_plain_value_is_what_typer_makes_of_it() -> None:
    """Values converted without pydantic (``plain_value``) equal typer's pydantic conversion, type included."""
    from ppsim.cli._app import _PYDANTIC, plain_value

    converted = 0
    for ctx, option in _options():
        for value in [*SAMPLES, option.default]:
            plain = plain_value(option, value)
            if plain is _PYDANTIC:
                continue
            converted += 1
            typer_made = option.get_runtime_param().coerce(value, param=option, ctx=ctx)
            assert (plain, type(plain)) == (typer_made, type(typer_made)), (option.name, value)
    assert converted > 50


@given(st.text(alphabet="0123456789", min_size=1, max_size=20))
@settings(max_examples=60, deadline=None)
def test_digits_convert_as_typer_converts_them(digits: str) -> None:
    from ppsim.cli._app import _PYDANTIC, plain_value

    for ctx, option in _INT_OPTIONS:
        plain = plain_value(option, digits)
        if plain is not _PYDANTIC:
            assert plain == option.get_runtime_param().coerce(digits, param=option, ctx=ctx)


_INT_OPTIONS = [(c, o) for c, o in _options() if o.type_descriptor.annotation is int]


def test_commands_without_linear_algebra_start_one_blas_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.cli import _one_blas_thread

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    restore = _one_blas_thread(["ppsim", "simulate", "-s", "1F1B"])
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    restore()
    assert "OPENBLAS_NUM_THREADS" not in os.environ  # the command's end puts the environment back
    for argv in (["ppsim", "run", "-s", "1F1B"], ["ppsim", "calibrate"], ["ppsim"]):  # workers inherit it: untouched
        _one_blas_thread(argv)()
        assert "OPENBLAS_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # the user's choice wins
    _one_blas_thread(["ppsim", "simulate"])()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"
