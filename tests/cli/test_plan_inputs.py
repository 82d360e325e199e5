"""`ppsim plan`'s inputs and outputs around the search: the output format, the node layout, the time limit, and
tables printed whole when stdout is not a terminal (ppsim.plan, ppsim.cli.plan, ppsim.cli.output)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()


# --- tables piped or redirected print whole ---------------------------------------------------------------------
@pytest.mark.parametrize("env", [{}, {"COLUMNS": "40"}])
def test_a_table_piped_or_redirected_prints_whole_names_and_column_heads(env: dict[str, str]) -> None:
    """CliRunner's stdout is not a terminal (as `> plan.txt`): no "Interleaved…", no "sched…", no name cut."""
    result = runner.invoke(app, ["simulate", "-s", "Interleaved1F1B,InterleavedZeroBubble,ZBVZeroBubble", "-r", "4",
                                 "-m", "8"], env=env)
    assert result.exit_code == 0, result.output
    for word in ("InterleavedZeroBubble", "Interleaved1F1B", "ZBVZeroBubble", "schedule", "makespan", "bubble",
                 "peak act.", "peak bytes"):
        assert word in result.stdout
    assert "…" not in result.stdout


def test_the_plan_table_piped_prints_every_schedule_name_and_column_head_whole(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from job.test_plan import _plan, _request

    from ppsim.cli.plan import print_plan

    monkeypatch.setenv("COLUMNS", "60")
    print_plan(_plan(_request(top=50)))
    out = capsys.readouterr().out
    for word in ("InterleavedZeroBubble", "Interleaved1F1B", "schedule", "peak GiB", "rel. step"):
        assert word in out
    assert "…" not in out


# --- the output format and the nodes, refused before any work ----------------------------------------------------
def _plan_args(*extra: str) -> list[str]:
    return ["plan", "--torchtitan-config", "llama3:llama3_debugmodel", "--memory-cap", "1GiB", *extra]


def test_plan_o_with_a_name_not_ending_in_html_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    page = tmp_path / "plan.png"
    result = runner.invoke(app, _plan_args("--gpus", "2", "-o", str(page)))
    assert result.exit_code == 2, result.output
    assert "plan writes one offline HTML page; use a name ending in .html" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not page.exists()


@pytest.mark.parametrize("value", ["0", "-2"])
def test_workers_below_one_is_one_line_exit_2(value: str) -> None:
    result = runner.invoke(app, _plan_args("--gpus", "2", "--workers", value))
    assert result.exit_code == 2, result.output
    assert f"--workers {value}: must be at least 1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_gpus_that_leave_a_node_partly_filled_are_refused_naming_both_and_the_fix() -> None:
    result = runner.invoke(app, _plan_args("--gpus", "4", "--gpus-per-node", "3"))
    assert result.exit_code == 2, result.output
    assert ("--gpus 4 with --gpus-per-node 3: the GPUs must fill whole nodes (4 is not a multiple of 3); use --gpus 3 "
            "or 6") in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_fewer_gpus_than_a_node_is_one_partial_node_said_in_one_line_with_tp_dividing_its_gpus() -> None:
    from job.test_plan import _request

    from ppsim.plan import ModelFacts, degree_layouts, node_layout

    assert node_layout(16, 8) == "" and node_layout(8, 8) == ""
    assert node_layout(3, 4).startswith("plan: --gpus 3 < --gpus-per-node 4: one node, 3 of its GPUs used")
    layouts = degree_layouts(_request(num_gpus=6, gpus_per_node=8, model=ModelFacts(6, 6, 6, "toy")), batch=24)
    assert {d.tp for d in layouts} == {1, 2, 3, 6}  # divisors of the node's 6 GPUs (3 and 6 are not of 8)


# --- the time limit is the whole command's -----------------------------------------------------------------------
def test_the_process_start_counts_the_interpreter_and_imports_before_main() -> None:
    """`ppsim` counts --time-limit from the process's start, not from when the command's body runs."""
    import subprocess
    import sys

    code = ("import time; time.sleep(0.6); from ppsim.cli import process_started; "
            "print(time.monotonic() - process_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 0.6 <= float(out) < 30.0


@pytest.mark.torch
def test_plan_counts_its_time_limit_from_when_the_process_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process started a limit ago (start-up, torchtitan's import) leaves no time to judge: the plan says the
    limit stopped it (exit 1), not the cap."""
    pytest.importorskip("torchtitan")
    import time

    import ppsim.cli

    monkeypatch.setattr(ppsim.cli, "_STARTED", [time.monotonic() - 50.0])
    result = runner.invoke(app, _plan_args("--gpus", "2", "--time-limit", "50"))
    assert result.exit_code == 1, result.output
    assert "Error: --time-limit 50: ran out after " in result.stderr
    assert "before any candidate was judged (start-up and reading the job took that long)" in result.stderr
    assert "the limit, not the memory cap, stopped the plan" in result.stderr and "Traceback" not in result.output


def test_a_command_run_in_process_after_main_counts_from_its_own_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """`main()` counts the first command from the process's start; once it returns, a command called in-process (a
    test runner's worker, long started) counts from its own start, so its time limit is not spent before it begins."""
    import sys
    import time

    from ppsim.cli import command_started, main

    monkeypatch.setattr(sys, "argv", ["ppsim", "--version"])
    with pytest.raises(SystemExit):
        main()
    after_main = time.monotonic()
    assert after_main <= command_started() <= time.monotonic()  # its own start, not the process's (no timed bound)
