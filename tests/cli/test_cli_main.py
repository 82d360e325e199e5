"""The `ppsim` entry point: --version, one line (never a traceback) for OS errors, encodings and Ctrl-C."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ppsim
import ppsim.cli
from ppsim.cli import app, main

runner = CliRunner()


def run_ppsim(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from ppsim.cli import main; main()", *args],
        capture_output=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120,
    )


def test_version_prints_the_package_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"ppsim {ppsim.__version__}"


@pytest.mark.parametrize(
    "args",
    [["show", "-s", "DualPipeV", "-r", "4", "-m", "8"], ["list"], ["simulate", "-s", "1F1B,DualPipeV", "-r", "4",
                                                                    "-m", "8"]],
)
def test_ascii_terminal_does_not_crash(args: list[str]) -> None:
    proc = run_ppsim(*args, env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0, proc.stderr.decode("ascii", "replace")
    assert b"Traceback" not in proc.stderr
    proc.stdout.decode("ascii")  # everything printed is ASCII (unencodable characters replaced)


def test_input_file_name_too_long_is_one_line(tmp_path: Path) -> None:
    proc = run_ppsim("validate", str(tmp_path / ("x" * 300 + ".csv")))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and "choose a shorter name" in err


def test_output_file_name_too_long_is_one_line(tmp_path: Path) -> None:
    proc = run_ppsim("export", "-s", "1F1B", "-r", "2", "-m", "2", "-o", str(tmp_path / ("x" * 300 + ".csv")))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and "choose a shorter name" in err


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(**kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ppsim.cli, "app", interrupted)
    monkeypatch.setattr(sys, "argv", ["ppsim", "simulate"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 130
    assert capsys.readouterr().err == "Interrupted.\n"


def test_ctrl_c_inside_a_command_is_not_silent(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """typer turns a KeyboardInterrupt in a command into a silent exit 130; ppsim's commands say so."""
    import ppsim.compare

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ppsim.compare, "compare", interrupted)
    monkeypatch.setattr(sys, "argv", ["ppsim", "simulate", "-s", "1F1B", "-r", "2", "-m", "2"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 130
    assert capsys.readouterr().err == "Interrupted.\n"


def test_os_error_with_a_file_name_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    def denied(**kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", "/root/secret.csv")

    monkeypatch.setattr(ppsim.cli, "app", denied)
    monkeypatch.setattr(sys, "argv", ["ppsim", "validate"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    expected = "Error: /root/secret.csv: permission denied; choose a path you can read or write\n"
    assert capsys.readouterr().err == expected


def test_python_dash_m_runs_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "ppsim.cli", "--version"], capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.decode().strip() == f"ppsim {ppsim.__version__}"
