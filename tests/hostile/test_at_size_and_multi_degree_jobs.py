"""Hostile inputs on the fifth round's surfaces (issue 26, "extend the hostile tests"): production-size
calibration, multi-degree torchtitan jobs, ``--memory-cap`` spellings, ``plan`` with absurd GPU counts, a rank
killed mid-step, and torch releases ppsim has not been tested with.

Each test is named after the behaviour it pins.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
PLAN = ["plan", "--torchtitan-config", "llama3:llama3_debugmodel", "--time-limit", "60"]
SIM = ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel"]


def error_line(result: object) -> str:
    """Exit 2, stderr ending in exactly one ``Error:`` line (a job's ``warning:`` lines may precede it), no
    traceback; returns the line."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    errors = [ln for ln in lines if not ln.startswith(("warning:", "plan: "))]  # warnings, plan's progress
    assert len(errors) == 1 and errors[0].startswith("Error:") and lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr and "ZeroDivisionError" not in result.stderr, result.stderr
    return errors[0]


# --- production-size models ------------------------------------------------------------------------------------
@pytest.mark.torch
def test_calibrating_405b_on_a_small_host_gives_the_estimate_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    line = error_line(runner.invoke(app, ["calibrate", "--model", "torchtitan:llama3/405B", "-o", str(out)]))
    assert "GiB" in line and "--allow-large" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.torch
@pytest.mark.parametrize(("args", "says"), [
    (["--seq-len", "1000000000000"], "--seq-len 1000000000000"),
    (["--seq-len", "-5"], "--seq-len -5"),
    (["--tp", "3"], "--tp 3"),
    (["--tp", "0"], "--tp 0"),
])
def test_absurd_production_calibration_options_are_one_line(args: list[str], says: str, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    line = error_line(runner.invoke(app, ["calibrate", "--model", "torchtitan:llama3/70B", *args, "-o", str(out)]))
    assert says in line and not out.exists()


# --- multi-degree torchtitan jobs ------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize(("overrides", "says"), [
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "3",
      "--parallelism.data_parallel_shard_degree", "1"], "3"),
    (["--parallelism.pipeline_parallel_degree", "7", "--parallelism.data_parallel_shard_degree", "1"], "7"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "0",
      "--parallelism.data_parallel_shard_degree", "1"], "tensor_parallel_degree 0: must be at least 1"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "0",
      "--parallelism.data_parallel_shard_degree", "1"], "context_parallel_degree 0"),
])
def test_torchtitan_degrees_that_do_not_divide_the_model_are_one_line(overrides: list[str], says: str) -> None:
    line = error_line(runner.invoke(app, [*SIM, *overrides, "--memory-cap", "80GiB"]))
    assert says in line


@pytest.mark.torch
@pytest.mark.parametrize(("args", "says"), [
    (["--tp", "3"], "3"), (["--dp-shard", "0"], "--dp-shard 0"), (["--tp", "-1"], "--tp -1"),
])
def test_run_degrees_that_cannot_be_launched_are_one_line_and_start_nothing(args: list[str], says: str) -> None:
    line = error_line(runner.invoke(app, ["run", "--torchtitan-config", "llama3:llama3_debugmodel",
                                          "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size",
                                          "2", "--training.seq_len", "64", *args]))
    assert says in line


# --- --memory-cap spellings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "num_bytes"), [("80GiB", 80 * 2**30), ("80gb", 80 * 10**9),
                                                 ("80 GiB", 80 * 2**30), ("80GB", 80 * 10**9)])
def test_memory_cap_reads_gb_as_decimal_and_gib_as_binary(text: str, num_bytes: int) -> None:
    from ppsim.io import parse_memory_cap

    assert parse_memory_cap(text).amount == num_bytes


@pytest.mark.torch
@pytest.mark.parametrize("text", ["-1GiB", "1e400GiB", "nanGiB", "infGiB", "80 parsecs", "8act"])
def test_a_malformed_memory_cap_for_a_torchtitan_job_is_one_line_naming_it(text: str) -> None:
    line = error_line(runner.invoke(app, [*PLAN, "--gpus", "2", "--memory-cap", text]))
    assert text in line


# --- plan ------------------------------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize(("gpus", "says"), [("0", "--gpus 0"), ("-1", "--gpus -1")])  # 7: FSDP alone (pp 1) fits
def test_plan_with_an_impossible_gpu_count_is_one_line(gpus: str, says: str) -> None:
    assert says in error_line(runner.invoke(app, [*PLAN, "--gpus", gpus, "--memory-cap", "1GiB"]))


@pytest.mark.torch
@pytest.mark.parametrize("option", ["--gpus", "--gpus-per-node"])
def test_plan_with_a_billion_gpus_enumerates_degrees_bounded_by_the_model_not_the_count(option: str) -> None:
    from ppsim import plan

    calls: list[int] = []
    real = plan._divisors

    def counted(n: int, *, at_most: int) -> list[int]:
        out = real(n, at_most=at_most)
        calls.append(len(out))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(plan, "_divisors", counted)
    try:
        args = ["--gpus", str(10**9), "--gpus-per-node", "8"] if option == "--gpus" else \
               ["--gpus", "2", "--gpus-per-node", str(10**9)]
        runner.invoke(app, [*PLAN, *args, "--memory-cap", "1KiB"])
    finally:
        mp.undo()
    assert calls and max(calls) <= 16  # the debug model's 6 layers and 16 heads bound the degrees


@pytest.mark.torch
def test_plan_with_a_cap_below_every_candidate_names_the_cap_as_given() -> None:
    line = error_line(runner.invoke(app, [*PLAN, "--gpus", "2", "--memory-cap", "1KiB"]))
    assert "1.00 KiB" in line and "0.00 GiB" not in line and "smallest peak" in line


def test_plan_top_zero_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ppsim.cli import main

    monkeypatch.setattr(sys, "argv", ["ppsim", *PLAN, "--gpus", "2", "--memory-cap", "1GiB", "--top", "0"])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "--top" in err[0], err


@pytest.mark.torch
def test_plan_with_a_zero_pinned_degree_is_one_line_not_a_division_by_zero() -> None:
    line = error_line(runner.invoke(app, [*PLAN, "--gpus", "4", "--memory-cap", "1GiB",
                                          "--parallelism.context_parallel_degree", "0"]))
    assert "--parallelism.context_parallel_degree 0: must be at least 1" in line


# --- torch releases --------------------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("version", ["2.12.0", "2.99.0", "nonsense"])
def test_an_untested_torch_release_is_refused_in_one_line(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ppsim.calibrate.execute import torch_adapter
    from ppsim.errors import PPSimError

    monkeypatch.delenv(torch_adapter.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch_adapter, "_checked", False)
    with pytest.raises(PPSimError) as info:
        torch_adapter.check()
    text = str(info.value)
    assert "\n" not in text and f"torch {version}" in text and "2.13" in text


@pytest.mark.torch
def test_a_newer_torch_with_the_override_runs_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from ppsim.calibrate.execute import torch_adapter

    monkeypatch.setenv(torch_adapter.OVERRIDE_ENV, "1")
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(torch_adapter, "_checked", False)
    torch_adapter.check()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "2.99.0" in err[0]


@pytest.mark.torch
def test_an_older_torch_is_refused_even_with_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ppsim.calibrate.execute import torch_adapter
    from ppsim.errors import PPSimError

    monkeypatch.setenv(torch_adapter.OVERRIDE_ENV, "1")
    monkeypatch.setattr(torch, "__version__", "2.12.0")
    monkeypatch.setattr(torch_adapter, "_checked", False)
    with pytest.raises(PPSimError, match="torch 2.12.0"):
        torch_adapter.check()


# --- a rank killed mid-step ------------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.slow
def test_a_rank_killed_mid_step_ends_every_process_leaves_no_file_and_is_named(tmp_path: Path) -> None:
    """The cheapest multi-process run (synthetic, 3 ranks) goes through the same launcher as PP x FSDP: one rank is
    SIGKILLed mid-step; the run ends with one line naming that rank, no process and no temporary file behind."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from processes import alive as _alive
    from processes import default_signals as _default_signals
    from processes import descendants as _descendants

    # A short TMPDIR of its own: the fork server's socket path must fit AF_UNIX's 108 bytes, which pytest's
    # tmp_path under xdist (/tmp/pytest-of-USER/pytest-N/popen-gwK/<test name>0/) can exceed.
    work = Path(tempfile.mkdtemp(prefix="ppsim-kill-", dir="/tmp"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppsim.cli", "run", "-s", "GPipe", "-r", "3", "-m", "2", "--synthetic", "--costs",
         "F=1,B=1", "--time-unit", "1", "--steps", "5", "--timeout", "300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(work)},
        preexec_fn=_default_signals, cwd=tmp_path,
    )
    seen: set[int] = set()
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= _descendants(proc.pid)
            children = _descendants(proc.pid)
            # the ranks are the fork server's children: grandchildren of the run
            ranks = sorted(p for p in _alive(children) if any(p in _descendants(c) for c in children))
            if len(ranks) >= 3:
                time.sleep(2.0)  # mid-step: every step takes seconds
                break
            time.sleep(0.05)
        assert proc.poll() is None and len(ranks) >= 3, "the run ended before a rank could be killed"
        victim = ranks[1]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # gloo's C++ transport logs each retried connect of a surviving rank to the killed one ("willRetry=1") before
    # the launcher ends it: torch's own log, not an error of the run; everything else is the one line
    lines = [ln for ln in err.decode().strip().splitlines() if not ("gloo" in ln and "willRetry=1" in ln)]
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert "rank" in lines[0] and "SIGKILL" in lines[0] and "Traceback" not in lines[0], lines
    wait_until = time.monotonic() + 15
    while _alive(seen) and time.monotonic() < wait_until:
        time.sleep(0.2)
    assert not _alive(seen), f"left behind: {_alive(seen)} of {seen}"
    # torch's own compile cache (torchinductor_USER) is made by importing torch, killed or not: not a leftover
    try:
        assert [p.name for p in work.iterdir() if not p.name.startswith("torchinductor_")] == []
        assert list(tmp_path.iterdir()) == []
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_temporary_folder_too_long_for_the_ranks_socket_is_one_line(tmp_path: Path) -> None:
    """The local ranks' fork server binds a socket in TMPDIR; a path longer than AF_UNIX allows is named in one line
    (exit 2), not a traceback (seen under pytest-xdist, whose tmp_path can exceed it)."""
    import os
    import subprocess
    import sys

    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "ppsim.cli", "run", "-s", "GPipe", "-r", "2", "-m", "2", "--synthetic", "--costs",
         "F=0.01,B=0.01", "--steps", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(deep)}, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "TMPDIR" in lines[0] and "Traceback" not in proc.stderr
