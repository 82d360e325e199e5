"""Hostile inputs, sixth pass: work that has been done is never lost to an output that cannot be written. The disk
fills between the up-front writability check and the write (simulated: the writer's temporary file for the named
output fails with ENOSPC); the command stops with one line, and the measurement (or the plan) is on stdout as JSON,
or kept in a file the line names."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--layers", "2", "--vocab", "32", "--seq-len", "8",
         "--mb-size", "1", "--reps", "1", "--warmup", "0", "--no-p2p", "--no-probe"]


def disk_full_for(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Writing an output named in ``names`` fails with ENOSPC once the work is done: the up-front check (a probe
    file beside it) passes, the atomic writer's bytes do not; other files are written."""
    import ppsim.io

    real = ppsim.io._emit

    def emit(fh: Any, content: Any) -> None:
        written = Path(os.readlink(f"/proc/self/fd/{fh.fileno()}")).name
        if any(re.fullmatch(rf"\.{re.escape(name[:40])}\.\w{{8}}\.tmp", written) for name in names):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fh, content)

    monkeypatch.setattr(ppsim.io, "_emit", emit)


def errors_of(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("Error:")]


class _Report:
    grad_ok = loss_match = True

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": "1F1B", "ranks": 2, "microbatches": 2, "measured_step_s": 1.25, "predicted_step_s": 1.0,
                "step_error_pct": 25.0}

    def measured_bars(self) -> list[Any]:
        return [(0, 0.0, 0.5, "0F0"), (1, 0.5, 1.25, "1F0")]

    def predicted_bars(self) -> list[Any]:
        return [(0, 0.0, 0.5, "0F0"), (1, 0.5, 1.0, "1F0")]


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "table"])
@pytest.mark.parametrize("failing", ["r.json", "p.png"])
def test_a_run_whose_output_or_plot_cannot_be_written_prints_its_measurement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str, json_out: bool) -> None:
    import ppsim.calibrate.execute.run as run_module

    monkeypatch.setattr(run_module, "execute", lambda options: _Report())
    monkeypatch.setattr("ppsim.cli.run.print_run_summary", lambda report: None)
    disk_full_for(monkeypatch, failing)
    full = tmp_path / "full"
    full.mkdir()
    result = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--costs", "F=1,B=1",
                                 "-o", str(full / "r.json"), "--plot", str(full / "p.png"),
                                 *(["--json"] if json_out else [])])
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)["measured_step_s"] == 1.25
    (line,) = errors_of(result.stderr)
    assert failing in line and "no space left" in line and "stdout" in line, line
    assert "Traceback" not in result.output


@pytest.mark.torch
def test_a_calibration_whose_profile_cannot_be_written_keeps_it_and_says_where(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "c.json"
    disk_full_for(monkeypatch, "c.json")
    result = runner.invoke(app, ["calibrate", *SMALL, "-o", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = errors_of(result.stderr)
    assert "no space left" in line and "Traceback" not in result.output
    kept = next(p for p in tmp_path.iterdir() if p.name != "c.json" and p.name.startswith("c.json"))
    assert str(kept) in line and "--resume" in line, line
    doc = json.loads(kept.read_text())
    assert "units" in doc["done"] and doc["units"]
    monkeypatch.undo()
    again = runner.invoke(app, ["calibrate", *SMALL, "-o", str(out), "--resume"])
    assert again.exit_code == 0, again.output
    assert json.loads(out.read_text())["complete"] and "measuring" not in again.stderr


@pytest.mark.torch
def test_a_plan_whose_page_cannot_be_written_prints_the_plan_as_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    monkeypatch.chdir(tmp_path)
    disk_full_for(monkeypatch, "plan.html")
    result = runner.invoke(app, ["plan", "--torchtitan-config", "llama3:llama3_debugmodel", "--gpus", "2",
                                 "--memory-cap", "1GiB", "-o", str(tmp_path / "plan.html")])
    assert result.exit_code == 2, result.output
    (line,) = errors_of(result.stderr)
    assert "plan.html" in line and "no space left" in line and "stdout" in line, line
    assert json.loads(result.stdout)["best"] is not None
