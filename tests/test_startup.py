"""Start-up: the short commands load only what they use (no numpy, pandas, rich tables, search machinery, frames)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numpy", "pandas", "rich.table", "ppsim.result", "ppsim.simulate", "ppsim.search.common",
         "ppsim.search.driver", "ppsim.search.cpsat", "ortools", "torch", "matplotlib", "pydantic", "ppsim.torchtitan",
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
    (["show", "-s", "1F1B", "-r", "2", "-m", "2"], ["pydantic", "typer"]),  # typer converts values with pydantic
])
def test_version_and_show_load_nothing_heavy(argv: list[str], expected: list[str]) -> None:
    assert _loaded_after(argv) == expected


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
    from ppsim.simulate import simulate

    assert ppsim.simulate is simulate  # the function, even after its module of the same name was imported
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
