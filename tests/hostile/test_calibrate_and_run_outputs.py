"""Hostile inputs, fifth pass (issue 34): the calibration estimate measures the dtype it will run, progress inside a
block, output targets that cannot take bytes (a full disk, /dev/full) refused before any work in one line, and a
fresh pass over ``run --dp-shard/--tp``, ``calibrate --tp`` and the profile's newer sections.

Each test is named after the behaviour it pins.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app, main
from ppsim.errors import OutputPathError, PPSimError

runner = CliRunner()


def ppsim_main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """The console entry point in this process (so monkeypatches apply): ``(exit code, stdout, stderr)``."""
    monkeypatch.setattr(sys, "argv", ["ppsim", *args])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def only_error_line(code: int, stderr: str) -> str:
    """Exit 2 and a stderr that is exactly one ``Error:`` line, no traceback; returns the line."""
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("Error:"), stderr
    assert "Traceback" not in stderr
    return lines[0]


def fill_up(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make ``folder`` behave as a full file system: every ``os.write`` into a file under it fails with ENOSPC (what
    a full disk says: files are created, bytes are refused)."""
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            where = ""
        if where.startswith(str(folder) + os.sep):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


# --- items 3 and 4: an output target that cannot take bytes is refused before any work ---------------------------
def test_dev_full_is_refused_by_the_output_check_in_one_line() -> None:
    from ppsim.io import check_writable, output_file

    with pytest.raises(OutputPathError, match=r"^/dev/full: the device takes no bytes"):
        output_file("/dev/full")
    with pytest.raises(OutputPathError, match=r"^-o /dev/full: the device takes no bytes.*choose a file$"):
        check_writable("/dev/full")
    check_writable("/dev/null")  # a device that takes bytes is still written into
    assert output_file("/dev/null") == Path("/dev/null")


def test_a_full_folder_is_refused_by_the_output_check_and_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.io import check_writable, output_file

    full = tmp_path / "full"
    full.mkdir()
    (full / "c.json").write_text("{\"keep\": 1}\n")
    fill_up(monkeypatch, full)
    for target in (full / "new.json", full / "c.json"):
        with pytest.raises(OutputPathError, match=r"^-o .*: no space left on the device; free some space"):
            check_writable(target, option="-o")
        with pytest.raises(OutputPathError, match="no space left"):
            output_file(str(target))
    assert sorted(p.name for p in full.iterdir()) == ["c.json"]  # the probe files are gone
    assert (full / "c.json").read_text() == "{\"keep\": 1}\n"


@pytest.mark.torch
def test_calibrate_onto_a_full_disk_is_one_line_exit_2_and_keeps_the_existing_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full"
    full.mkdir()
    old = full / "c.json"
    old.write_text("{\"keep\": 1}\n")
    fill_up(monkeypatch, full)
    small = ["--preset", "tiny", "--reps", "1", "--warmup", "0", "--no-p2p", "--no-probe"]
    for target in (full / "new.json", old):
        code, out, err = ppsim_main(capsys, monkeypatch, "calibrate", *small, "-o", str(target))
        assert "no space left on the device" in only_error_line(code, err)
        assert out == ""
    assert old.read_text() == "{\"keep\": 1}\n"
    assert sorted(p.name for p in full.iterdir()) == ["c.json"]  # no lock, no partial, no probe


def test_the_one_writer_lock_on_a_full_disk_is_one_line_and_removed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.io import exclusive_writer

    fill_up(monkeypatch, tmp_path)
    with pytest.raises(OutputPathError, match=r"^-o .*c\.json: no space left on the device"), \
            exclusive_writer(tmp_path / "c.json"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_disk_filling_during_the_write_keeps_the_existing_file(tmp_path: Path) -> None:
    from ppsim.io import write_atomic

    old = tmp_path / "c.json"
    old.write_text("old\n")

    def fills(fh: Any) -> None:
        fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputPathError, match=r"^-o .*c\.json: no space left on the device"):
        write_atomic(old, fills)
    assert old.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["c.json"]


@pytest.mark.torch
@pytest.mark.parametrize("option", [["--json", "-o", "FULL/r.json"], ["--plot", "FULL/p.png"], ["-o", "/dev/full"],
                                    ["--plot", "/dev/full"]])
def test_run_with_an_output_target_that_takes_no_bytes_says_only_the_error_and_runs_nothing(
        option: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ppsim.calibrate.execute.run as run_module

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(run_module, "execute", never)
    full = tmp_path / "full"
    full.mkdir()
    fill_up(monkeypatch, full)
    args = [a.replace("FULL", str(full)) for a in option]
    code, out, err = ppsim_main(capsys, monkeypatch, "run", "-s", "1F1B", "-r", "1", "-m", "2", "--preset", "tiny",
                                *args)
    line = only_error_line(code, err)
    assert "no space left" in line or "takes no bytes" in line
    assert out == "" and "parameters" not in err


def test_plan_output_onto_dev_full_is_refused_before_the_plan_and_its_memory_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan -o`` is parsed by ``output_file``: /dev/full is refused there, before the memory line."""
    code, out, err = ppsim_main(capsys, monkeypatch, "plan", "--torchtitan-config", "llama3:llama3_debugmodel",
                                "--gpus", "2", "--memory-cap", "80GiB", "--time-limit", "5", "-o", "/dev/full")
    assert "takes no bytes" in only_error_line(code, err) and out == ""


# --- item 1: the estimate measures the dtype it will run -----------------------------------------------------------
EPYC = {"bfloat16": 0.29e9, "float32": 25e9}
"""bfloat16 and float32 matmul speeds of an AMD EPYC without AVX512-BF16/AMX (one thread): 32 x 8192 @ 8192 x 8192
took 15 s in bfloat16 against 0.17 s in float32."""


def slow_bf16(monkeypatch: pytest.MonkeyPatch, speeds: dict[str, float] = EPYC) -> list[tuple[Any, ...]]:
    """The probe returns ``speeds`` (a CPU without a fast bfloat16 path); returns the probes asked for."""
    from ppsim.calibrate.measure import speed

    asked: list[tuple[Any, ...]] = []

    def probe(device: str, dtype: str, rows: int, inner: int, cols: int) -> float:
        asked.append((device, dtype, rows, inner, cols))
        return speeds[dtype]

    monkeypatch.setattr(speed, "matmul_flops_per_s", probe)
    return asked


@pytest.mark.torch
def test_the_probe_is_short_and_sized_from_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short by construction (no wall-clock assert: a shared host's stall is not a bug): the shape is capped and
    the timed products are five (one set-up, one sizing, the best of three), each sized to about BUDGET_S."""
    import torch

    from ppsim.calibrate.measure.speed import BUDGET_S, measure_speed, probe_shape
    from ppsim.model_config import PRESETS

    eight = PRESETS["8b"].replace(seq_len=32)
    assert probe_shape(eight, "cpu") == (32, 4096, 4096)  # tokens x hidden @ hidden x (up to) the FFN, capped
    assert probe_shape(PRESETS["tiny"], "cpu") == (256, 128, 352)
    assert BUDGET_S <= 0.1
    products: list[tuple[int, ...]] = []
    real_full = torch.full

    def counted_full(size: tuple[int, ...], *args: object, **kwargs: object) -> torch.Tensor:
        products.append(tuple(size))
        return real_full(size, *args, **kwargs)

    monkeypatch.setattr(torch, "full", counted_full)
    speed = measure_speed(eight.replace(mb_size=3), "cpu")  # a shape not probed before in this process
    assert len(products) <= 2 * 3 and all(size[0] <= 4096 and size[-1] <= 4096 for size in products), products
    assert speed.dtype == "bfloat16" and speed.flops_per_s > 0 and (speed.float32_flops_per_s or 0) > 0
    assert measure_speed(PRESETS["tiny"], "cpu").float32_flops_per_s is None  # float32: nothing to compare with


@pytest.mark.torch
def test_the_estimate_divides_by_the_measured_speed_of_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from ppsim.calibrate.measure import calibration as cal
    from ppsim.model_config import PRESETS

    config = PRESETS["tiny"].replace(dtype="bfloat16")
    opts = cal.CalibrationOptions(output=Path("unused.json"), config=config, reps=3, warmup=1, probe=False)

    def minutes(speeds: dict[str, float]) -> float:
        slow_bf16(monkeypatch, speeds)
        line = cal.estimate_line(opts)
        assert f"bfloat16 matmuls at {speeds['bfloat16'] / 1e9:.3g} GFLOP/s" in line, line
        return float(re.search(r"about ([0-9.]+) min on cpu", line).group(1))

    fast, slow = minutes({"bfloat16": 50e9, "float32": 50e9}), minutes(EPYC)
    assert slow / max(fast, 0.05) > 50  # 172x slower in the probe; the fast one rounds to 0.0 min


@pytest.mark.torch
def test_a_slow_dtype_gets_one_warning_naming_both_speeds_and_the_faster_dtype(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ppsim.cli.calibrate as cli_calibrate

    asked = slow_bf16(monkeypatch)
    monkeypatch.setattr(cli_calibrate, "_calibrate", lambda request: None)  # the warning, not the measurement
    result = runner.invoke(app, ["calibrate", "--preset", "tiny", "--dtype", "bfloat16", "--reps", "1", "--warmup",
                                 "0", "--no-probe", "--no-p2p", "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 0, result.output
    warnings = [ln for ln in result.stderr.splitlines() if "slower than float32" in ln]
    assert len(warnings) == 1, result.stderr
    assert "0.29 GFLOP/s" in warnings[0] and "25 GFLOP/s" in warnings[0] and "--dtype float32" in warnings[0]
    assert {dtype for _, dtype, *_ in asked} == {"bfloat16", "float32"}
    assert {shape for *_, shape in [(a[2:],) for a in asked]} == {(256, 128, 352)}


@pytest.mark.torch
def test_8b_in_a_slow_bfloat16_is_refused_with_the_estimate_and_the_speeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    slow_bf16(monkeypatch)
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["calibrate", "--model", "torchtitan:llama3/8B", "--dtype", "bfloat16", "--seq-len",
                                 "32", "--reps", "1", "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    assert "would take about" in lines[0] and "(limit 1 h)" in lines[0] and "--allow-large" in lines[0]
    assert "0.29 GFLOP/s" in lines[0] and "--dtype float32 would take about" in lines[0]
    assert not out.exists()


# --- item 2: progress inside a block, and Ctrl-C during one ---------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_block_reports_each_pass_with_the_time_so_far_and_the_estimate_left() -> None:
    from ppsim.calibrate.measure.harness import BlockProgress

    clock, lines = FakeClock(), []
    progress = BlockProgress(["layers1"], warmup=0, reps=2, log=lines.append, clock=clock)
    progress.at("layers1", "the first forward")
    clock.now = 1.0
    progress.passed("F")  # 1 s into the block: quiet
    assert lines == []
    progress.at("layers1", "repetition 1/2")
    for name, seconds in (("F", 1.0), ("B", 10.0), ("I", 5.0), ("W", 5.0), ("F&B", 11.0)):
        clock.now += seconds
        progress.passed(name)
    assert [ln.split(":")[1].split(" of ")[0].strip() for ln in lines] == ["B", "I", "W", "F&B"]
    assert lines[-1] == "  layers1: F&B of repetition 1/2 done in 11.0 s; 33.0 s so far, about 32.0 s left"


@pytest.mark.torch
def test_calibrate_prints_every_pass_of_a_block_that_takes_long(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.measure import harness

    monkeypatch.setattr(harness, "PROGRESS_AFTER_S", 0.0)  # every block "takes long"
    monkeypatch.setattr(harness, "PROGRESS_EVERY_S", 0.0)
    result = runner.invoke(app, ["calibrate", "--preset", "tiny", "--layers", "2", "--reps", "1", "--warmup", "0",
                                 "--no-p2p", "--no-probe", "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 0, result.output
    passes = [ln for ln in result.stderr.splitlines() if ln.startswith("  layers1: ") and "so far, about" in ln]
    assert [ln.split(": ")[1].split(" of ")[0] for ln in passes] == ["F", "F", "B", "I", "W", "F&B"], result.stderr
    assert passes[-1].endswith("left") and "repetition 1/1" in passes[-1]


@pytest.mark.torch
def test_ctrl_c_inside_a_block_keeps_the_blocks_measured_says_so_and_resume_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    from ppsim.calibrate.measure import calibration as cal
    from ppsim.calibrate.measure import harness
    from ppsim.cli.calibrate import _calibrate
    from ppsim.io import progress_path
    from ppsim.model_config import PRESETS

    out = tmp_path / "c.json"
    opts = cal.CalibrationOptions(output=out, config=PRESETS["tiny"].replace(layers=2), reps=1, warmup=0, p2p=False,
                                  probe=False, at_size=True)  # one block at a time, each saved when measured
    real = harness.StageBench.timing_rep

    def interrupted_in_the_head(self: Any, *args: Any, **kwargs: Any) -> list[float]:
        if self.unit.name == "head":
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(harness.StageBench, "timing_rep", interrupted_in_the_head)
    with pytest.raises(typer.Exit) as info:
        _calibrate(opts)
    assert info.value.exit_code == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("interrupted; finished measurements are in") and "--resume" in said
    kept = json.loads(progress_path(out).read_text())["units"]
    assert sorted(kept) == ["layers1"] and not out.exists()
    monkeypatch.setattr(harness.StageBench, "timing_rep", real)
    doc = cal.calibrate(opts.__class__(**{**opts.__dict__, "resume": True}), log=lambda line: None)
    assert doc is not None and doc["complete"] and doc["units"]["layers1"] == kept["layers1"]  # not measured again
    assert sorted(doc["units"]) == ["embed", "head", "layers1"] and not progress_path(out).exists()


@pytest.mark.slow
@pytest.mark.torch
def test_ctrl_c_inside_one_long_torch_operation_ends_the_command_within_the_grace(tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    code = ("import sys, torch\nfrom ppsim.calibrate.measure.interrupt import prompt_interrupt\n"
            "torch.set_num_threads(1)\na = torch.ones(4096, 4096)\nb = torch.ones(4096, 16384)\n"
            "print('ready', flush=True)\nwith prompt_interrupt('interrupted; one line', grace_s=0.3):\n"
            "    for _ in range(20):\n        a @ b\nprint('finished', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)  # the grace ended it: the 20 products never finished
    assert err.strip().splitlines()[-1] == "interrupted; one line" and "finished" not in out


@pytest.mark.torch
def test_ctrl_c_before_anything_is_measured_says_nothing_was_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.measure import calibration as cal

    def interrupted(opts: Any) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(cal, "estimate_line", interrupted)  # the first thing a calibration prints
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["calibrate", "--preset", "tiny", "--no-p2p", "--no-probe", "-o", str(out)])
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1] == (f"interrupted before anything was measured; nothing written "
                                                      f"({out} is untouched)")
    assert list(tmp_path.iterdir()) == []


# --- item 5: run --dp-shard/--tp ------------------------------------------------------------------------------------
RUN_TITAN = ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--model", "torchtitan:llama3/debugmodel", "--steps", "1",
             "--warmup", "0"]


def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrating or launching fails the test: a refusal must come first."""
    import ppsim.calibrate.execute.run as run_module

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("calibration or run started before the refusal")

    monkeypatch.setattr(run_module, "calibrate_here", started)
    monkeypatch.setattr(run_module, "costs_and_model", started)


@pytest.mark.torch
@pytest.mark.parametrize("degrees", [["--dp-shard", "1000"], ["--tp", "2", "--dp-shard", "8"]])
def test_run_with_more_fsdp_tp_processes_than_the_host_holds_is_refused_before_calibrating(
        degrees: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    nothing_runs(monkeypatch)
    monkeypatch.setattr("ppsim.step.sharing.host_cores", lambda: 2)
    result = runner.invoke(app, [*RUN_TITAN, *degrees])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: ") and "processes" in line and "CPU core" in line and "--allow-large" in line, line


@pytest.mark.torch
def test_run_with_an_absurd_fsdp_degree_is_refused_even_with_allow_large_instead_of_hanging(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    nothing_runs(monkeypatch)
    result = runner.invoke(app, [*RUN_TITAN, "--dp-shard", "99999999999999999999", "--allow-large"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: --dp-shard 99999999999999999999") and "processes" in line, line


@pytest.mark.torch
def test_run_synthetic_with_tp_names_synthetic_not_the_model_as_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    result = runner.invoke(app, [*RUN_TITAN, "--tp", "2", "--synthetic"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "--synthetic" in line and "is not a torchtitan model" not in line, line


# --- item 5: calibrate --tp and calibration at size -----------------------------------------------------------------
CAL_TITAN = ["calibrate", "--model", "torchtitan:llama3/debugmodel", "--reps", "1", "--warmup", "0", "--no-p2p",
             "--no-probe"]


@pytest.mark.torch
def test_calibrate_tp_beyond_the_hosts_cores_is_refused_before_measuring(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    monkeypatch.setattr("ppsim.step.sharing.host_cores", lambda: 2)
    out = tmp_path / "c.json"
    result = runner.invoke(app, [*CAL_TITAN, "--tp", "16", "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --tp 16") and "core" in lines[0], result.stderr
    assert "--allow-large" in lines[0] and list(tmp_path.iterdir()) == []


@pytest.mark.torch
def test_calibrate_check_stages_at_size_is_refused_in_one_line_before_measuring(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    out = tmp_path / "c.json"
    result = runner.invoke(app, [*CAL_TITAN, "--tp", "2", "--check-stages", "-o", str(out)])
    assert result.exit_code == 2, result.output
    error = [ln for ln in result.stderr.strip().splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and "--check-stages" in error[0] and "at size" in error[0], result.stderr
    assert "Traceback" not in result.stderr and "measuring" not in result.stderr
    assert list(tmp_path.iterdir()) == []


# --- item 5: the profile's newer sections -------------------------------------------------------------------------
DEBUG_PROFILE = Path(__file__).parents[1] / "data" / "llama3_debugmodel_s32.profile.json"


@pytest.mark.torch
def test_run_with_a_profile_measured_at_another_tp_degree_says_what_its_prediction_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile measured at --tp 2 holds one rank's layer costs of a two-way split: a --tp 1 run predicted from
    them was silently low (exit 0, no word). It still runs (the benches run a --tp 2 job on one --tp 1 profile), with
    a warning before the run and the note in the run JSON."""
    import ppsim.calibrate.execute.run as run_module

    doc = json.loads(DEBUG_PROFILE.read_text())
    doc["tensor_parallel_degree"] = 2
    profile = tmp_path / "tp2.json"
    profile.write_text(json.dumps(doc))
    seen: dict[str, Any] = {}

    def stop_at_launch(self: Any, spec: Any) -> None:
        seen["launched"] = True
        raise KeyboardInterrupt

    from ppsim.calibrate.torchtitan.runner import TorchtitanRunner

    monkeypatch.setattr(TorchtitanRunner, "launch", stop_at_launch)
    real_costs = run_module.profile_costs

    def keep_notes(*args: Any, **kwargs: Any) -> Any:
        out = real_costs(*args, **kwargs)
        seen["notes"] = out[0].notes
        return out

    monkeypatch.setattr(run_module, "profile_costs", keep_notes)
    result = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(profile), "--steps", "1",
                                 "--warmup", "0"])
    assert result.exit_code == 130 and seen.get("launched"), result.output
    warnings = [ln for ln in result.stderr.splitlines() if "measured at tensor_parallel_degree 2" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "a lower bound" in warnings[0]
    assert "calibrate with --tp 1" in warnings[0]
    assert any("tensor_parallel_degree 2" in note for note in seen["notes"])


@pytest.mark.torch
def test_resume_at_another_tp_degree_is_refused_instead_of_mixing_the_degrees(tmp_path: Path) -> None:
    """A --tp 2 calibration's finished blocks are one rank's of a two-way split: resuming it at --tp 1 mixed them with
    unsharded blocks in one profile (it did, silently)."""
    from ppsim.calibrate.measure import calibration as cal
    from ppsim.io import progress_path
    from ppsim.model_config import PRESETS

    out = tmp_path / "c.json"
    opts = cal.CalibrationOptions(output=out, config=PRESETS["tiny"].replace(layers=2), reps=1, warmup=0, p2p=False,
                                  probe=False, at_size=True)
    doc = cal.new_document(opts, device=__import__("torch").device("cpu"), world_size=1, backend=None)
    doc["tensor_parallel_degree"] = 2  # as `calibrate --tp 2` writes it, killed before its first block finished
    progress_path(out).write_text(json.dumps(doc))
    said = r"^--resume: .* was measured with --tp 2 --mb-size 4, not --tp 1 --mb-size 4; repeat the original"
    with pytest.raises(PPSimError, match=said):
        cal.calibrate(opts.__class__(**{**opts.__dict__, "resume": True}), log=lambda line: None)
    assert json.loads(progress_path(out).read_text()) == doc and not out.exists()
