"""Hostile inputs, fourth pass (issue 26): no file lost to an interrupted calibration, no traceback from a profile's
numbers or a bad option value, no silent wrong answer.

Each test is named after the behaviour it pins; the issue's item number is in its docstring.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app, main
from ppsim.errors import OutputPathError

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "tests" / "data" / "llama3_debugmodel_s32.profile.json"
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--layers", "2", "--vocab", "32", "--seq-len", "8",
         "--mb-size", "1", "--reps", "1", "--warmup", "0", "--no-p2p", "--no-probe"]
"""A calibration that takes about a second."""


def error_line(result: object) -> str:
    """Exit 2, stderr exactly one ``Error:`` line (nothing before it), no traceback; returns the line."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    return lines[0]


def progress_path(path: Path) -> Path:
    from ppsim.io import progress_path as where

    return where(path)


def exclusive_writer(path: Path) -> object:
    from ppsim.io import exclusive_writer as lock

    return lock(path)


def main_error(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The console entry point's one line for ``ppsim ARGV`` (exit 2)."""
    monkeypatch.setattr(sys, "argv", ["ppsim", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    return err[0]


# --- data loss ---------------------------------------------------------------------------------------------------
@pytest.mark.torch
def test_an_interrupted_calibration_leaves_the_previous_file_intact(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1: Ctrl-C during a calibration into an existing file leaves that file as it was."""
    from ppsim.calibrate.measure import calibration

    out = tmp_path / "c.json"
    out.write_text('{"mine": 1}\n')

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(calibration, "measure_units", interrupted)
    result = runner.invoke(app, ["calibrate", "-o", str(out), *SMALL])
    assert result.exit_code == 130
    assert out.read_text() == '{"mine": 1}\n'
    assert progress_path(out).exists() and "--resume" in result.stderr


@pytest.mark.torch
def test_a_failed_calibration_leaves_the_previous_file_intact_and_resume_finishes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1: a calibration failing with an error leaves -o as it was; --resume then finishes it into -o."""
    from ppsim.calibrate.measure import calibration
    from ppsim.errors import PPSimError

    out = tmp_path / "c.json"
    out.write_text('{"mine": 1}\n')

    def failing(*args: object, **kwargs: object) -> None:
        raise PPSimError("probe failed")

    args = ["calibrate", "-o", str(out), *SMALL[:-1]]  # with the probe, which fails after the units
    monkeypatch.setattr(calibration, "run_probes", failing)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "probe failed" in result.stderr
    assert out.read_text() == '{"mine": 1}\n'
    monkeypatch.setattr(calibration, "measure_units", lambda *a, **k: pytest.fail("units measured twice"))
    result = runner.invoke(app, [*args, "--no-probe", "--resume"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["complete"] is True
    assert not progress_path(out).exists()


@pytest.mark.torch
def test_a_second_writer_of_the_same_profile_is_refused(tmp_path: Path) -> None:
    """Item 3: while one calibration writes c.json, a second `calibrate --resume -o c.json` is refused."""
    out = tmp_path / "c.json"
    with exclusive_writer(out):
        line = error_line(runner.invoke(app, ["calibrate", "-o", str(out), *SMALL, "--resume"]))
    assert "another ppsim process" in line and "c.json" in line
    assert not out.exists() and not progress_path(out).exists()


def test_the_writer_lock_is_released_and_removed() -> None:
    """Item 3: the lock leaves no file behind and can be taken again at once."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "c.json"
        with exclusive_writer(out):
            pass
        with exclusive_writer(out):
            pass
        assert list(Path(folder).iterdir()) == []


def test_search_never_replaces_its_input_profile(tmp_path: Path) -> None:
    """Item 2: `search --profile q.json -o q.json` is refused before the search."""
    q = tmp_path / "q.json"
    q.write_bytes(PROFILE.read_bytes())
    line = error_line(runner.invoke(app, ["search", "-r", "2", "-m", "4", "--profile", str(q), "--memory-cap", "8act",
                                          "-o", str(q)]))
    assert "--profile" in line
    assert q.read_bytes() == PROFILE.read_bytes()


# --- wrong or silent answers ---------------------------------------------------------------------------------------
@pytest.mark.torch
def test_check_stages_with_a_stage_holding_only_the_head_finishes_the_profile(tmp_path: Path) -> None:
    """Item 7: more stages than layers leave a stage with the embedding or head alone; the profile is complete."""
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["calibrate", "-o", str(out), *SMALL, "--check-stages", "--stages", "3"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["complete"] and [s["layers"] for s in doc["stages"]][-1] == [2, 2]


@pytest.mark.parametrize("cmd", [["export", "-s", "1F1B", "-r", "2", "-m", "2"],
                                 ["plot", "-s", "1F1B", "-r", "2", "-m", "2"],
                                 ["search", "-r", "2", "-m", "2", "--memory-cap", "8act"]])
def test_an_output_ending_in_a_slash_is_a_folder_not_a_file(cmd: list[str], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 8: `-o newdir/` for a folder that does not exist is refused; no file named newdir appears."""
    monkeypatch.chdir(tmp_path)
    line = main_error([*cmd, "-o", "newdir/"], capsys, monkeypatch)
    assert "'newdir/'" in line and "folder" in line
    assert not (tmp_path / "newdir").exists()


# --- messages -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option,value", [("--time-limit", "soon"), ("--seed", "junk"), ("--seed", "1.5"),
                                          ("-r", "two")])
def test_a_bad_number_names_the_option_and_the_value(option: str, value: str, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 12: typer's generic "Input should be a valid number" becomes one line naming the option and value."""
    args = ["search", "-r", "2", "-m", "2", "--memory-cap", "8act", option, value]
    line = main_error(args, capsys, monkeypatch)
    assert f"{option} {value!r}" in line and "Input should be" not in line


# --- the test suite itself -------------------------------------------------------------------------------------------
def test_signal_tests_pass_when_pytest_starts_with_sigint_and_sighup_ignored(tmp_path: Path) -> None:
    """Item 17: `nohup python -m pytest ... &` starts pytest with SIGINT and SIGHUP ignored; the tests that send them
    set the dispositions they depend on (the slow run-kill test sets them in its child the same way)."""
    import os
    import signal
    import subprocess

    def ignored() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    tests = [f"{REPO}/tests/hostile/test_bad_inputs_one_line.py::{name}" for name in (
        "test_ctrl_c_while_workers_start_is_raised_after_the_start",
        "test_a_hangup_while_writing_leaves_no_temporary_file")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=ignored,
                          env={**os.environ, "PYTEST_ADDOPTS": ""})
    assert proc.returncode == 0, proc.stdout[-3000:]


# --- tracebacks -------------------------------------------------------------------------------------------------------
def _profile(tmp_path: Path, name: str, change: object) -> Path:
    doc = json.loads(PROFILE.read_text())
    change(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _tiny_bandwidth(doc: dict) -> None:
    doc["p2p"] = {"alpha_s": 0.0, "beta_bytes_per_s": 1e-300, "fit_rel_error": 0.0, "measured": True, "samples": [],
                  "pairs": []}


def _all_zero(doc: dict) -> None:
    for part in (*doc["blocks"].values(), doc.get("stage_overhead") or {}):
        for stat in part.values():
            if isinstance(stat, dict) and "median" in stat:
                stat.update(median=0.0, p10=0.0, p90=0.0, samples=[0.0] * len(stat.get("samples") or [0.0]))


@pytest.mark.parametrize("cmd", [["export", "--format", "chrome", "-o", "t.json"], ["plot", "--comm", "-o", "t.svg"],
                                 ["simulate"]])
def test_a_profile_with_a_tiny_bandwidth_is_refused_in_one_line(cmd: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 5: op or hand-off times beyond the --costs limit are refused from a profile too (no OverflowError)."""
    monkeypatch.chdir(tmp_path)
    path = _profile(tmp_path, "slow.json", _tiny_bandwidth)
    line = error_line(runner.invoke(app, [cmd[0], "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(path),
                                          *cmd[1:]]))
    assert "hand-off" in line and "1e+12" in line
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "t.svg").exists()


def test_a_billion_layers_is_refused_in_one_line(tmp_path: Path) -> None:
    """Item 4: `calibrate --layers 1000000000` is refused by the layer limit before any per-layer list is built."""
    line = error_line(runner.invoke(app, ["calibrate", "--no-probe", "--no-p2p", "--layers", "1000000000",
                                          "-o", str(tmp_path / "c.json")]))
    assert "--layers 1,000,000,000" in line


def test_running_out_of_memory_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: a MemoryError (sizes --allow-large let through) ends in one line, not a traceback."""
    import importlib

    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(importlib.import_module("ppsim.simulator"), "simulate", exhausted)
    line = error_line(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--allow-large"]))
    assert "out of memory" in line


# --- silent answers ---------------------------------------------------------------------------------------------------
def test_a_profile_whose_op_times_are_all_zero_is_refused(tmp_path: Path) -> None:
    """Item 9: the rule `--costs F=0,B=0` meets applies to a profile of zeros."""
    path = _profile(tmp_path, "zero.json", _all_zero)
    line = error_line(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(path)]))
    assert "every op takes 0" in line


# --- messages and outputs ---------------------------------------------------------------------------------------------
@pytest.mark.torch
def test_a_failing_command_prints_only_its_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 13: a refused calibration prints no informational line ("model builtin:...", a warning) before its error."""
    line = error_line(runner.invoke(app, ["calibrate", "--stages", "3", "--layers", "100000", "-o",
                                          str(tmp_path / "a.json")]))
    assert "100,000 layers" in line
    from ppsim.calibrate.measure import calibration

    out = tmp_path / "c.json"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(calibration, "measure_units", interrupted)
    assert runner.invoke(app, ["calibrate", "-o", str(out), *SMALL]).exit_code == 130
    args = ["calibrate", "-o", str(out), *SMALL, "--resume"]
    args[args.index("--reps") + 1] = "2"
    assert "--resume" in error_line(runner.invoke(app, args))


def test_run_json_reaches_stdout_when_the_output_file_cannot_be_written(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 14: `run --json -o FILE` on a full disk still prints the measurement; without --json it is printed too."""
    import ppsim.calibrate.execute.run as run_module

    class Report:
        grad_ok = loss_match = True

        def to_dict(self) -> dict:
            return {"schedule": "1F1B", "measured_step_s": 1.25}

    def disk_filled_meanwhile(path: object, content: object, **kwargs: object) -> None:
        raise OutputPathError(f"-o {path}: no space left on the device; free some space or choose another folder")

    monkeypatch.setattr(run_module, "execute", lambda options: Report())
    monkeypatch.setattr("ppsim.cli.run.print_run_summary", lambda report: None)
    monkeypatch.setattr("ppsim.io.write_atomic", disk_filled_meanwhile)  # /dev/full itself is refused up front
    for extra in (["--json"], []):
        result = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--costs", "F=1,B=1",
                                     "-o", str(tmp_path / "r.json"), *extra])
        assert result.exit_code == 2, result.output
        assert json.loads(result.stdout)["measured_step_s"] == 1.25
        assert "no space left" in result.stderr and "stdout" in result.stderr


def test_report_search_skips_a_searched_order_the_split_does_not_fit(tmp_path: Path) -> None:
    """Item 10: a --split that fits the named schedules but not the searched order skips the searched one, with its
    reason, as a named one is skipped; the report is written."""
    out = tmp_path / "r.html"
    result = runner.invoke(app, ["report", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", str(PROFILE), "--split",
                                 "3,3", "--search", "--memory-cap", "8act", "--search-time", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "skipped Searched" in result.stderr and "--split 3,3" in result.stderr
    assert out.exists()


# --- item 18: a calibration on a busy host says so, and so does every use of it ------------------------------------
@pytest.mark.parametrize("load,cpus,spread,busy", [(1.0, 2, 0.1, False), (3.5, 2, 0.1, True), (3.5, 64, 0.1, False),
                                                   (1.0, 64, 1.5, True)])
def test_the_host_warning_follows_the_load_and_the_spread(load: float, cpus: int, spread: float, busy: bool) -> None:
    from ppsim.profile import HostLoad

    line = HostLoad(load_avg=load, num_cpus=cpus, spread=spread).warning("c.json")
    assert (line is not None) == busy
    assert line is None or ("c.json" in line and "busy host" in line)


def test_a_cpu_probe_whose_ranks_ran_much_slower_together_than_alone_warns_of_a_busy_host() -> None:
    """Each probe rank had a core of its own, yet together they ran 1.5 x slower than alone: other work held cores
    (seen: a 2-rank probe at 1.33-1.47 x between two quiet ones at 1.0)."""
    import dataclasses

    from profile_v2 import make_v2_profile

    from ppsim.profile import HostLoad

    base = make_v2_profile()  # compute_scale {1: 1.0, 2: 1.5}
    assert base.method is not None and base.runtime is not None
    quiet = dataclasses.replace(base.method, host=HostLoad(load_avg=1.0, num_cpus=2, spread=0.1))
    line = dataclasses.replace(base, method=quiet).host_warning("p.json")
    assert line is not None and "busy host" in line and "1.50 x slower together" in line and "p.json" in line
    calm = dataclasses.replace(base.runtime, compute_scale={1: 1.0, 2: 1.1})
    assert dataclasses.replace(base, method=quiet, runtime=calm).host_warning("p.json") is None
    assert dataclasses.replace(base, method=quiet, device="cuda").host_warning("p.json") is None
    one_core = dataclasses.replace(base.method, host=HostLoad(load_avg=0.5, num_cpus=1, spread=0.1))
    assert dataclasses.replace(base, method=one_core).host_warning("p.json") is None  # 2 ranks on 1 core: sharing


def _busy(doc: dict) -> None:
    doc["method"]["host"] = {"load_avg": 4.0, "num_cpus": 2, "spread": 0.2}


def test_simulate_repeats_the_busy_host_warning_of_its_profile(tmp_path: Path) -> None:
    """Item 18: `simulate --profile` of a profile calibrated on a busy host warns; a quiet one does not."""
    busy = _profile(tmp_path, "busy.json", _busy)
    result = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(busy)])
    assert result.exit_code == 0 and "busy host" in result.stderr and "busy.json" in result.stderr
    quiet = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(PROFILE)])
    assert quiet.exit_code == 0 and "busy host" not in quiet.stderr


@pytest.mark.torch
def test_a_calibration_records_the_host_load_and_warns_when_busy(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 18: the profile holds the load and spread the calibration saw; a busy host gets a warning."""
    from ppsim.calibrate.measure import calibration

    monkeypatch.setattr(calibration, "_load_avg", lambda: 64.0)
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["calibrate", "-o", str(out), *SMALL])
    assert result.exit_code == 0, result.output
    host = json.loads(out.read_text())["method"]["host"]
    assert host["load_avg"] == 64.0 and host["num_cpus"] >= 1 and host["spread"] >= 0
    assert "busy host" in result.stderr
