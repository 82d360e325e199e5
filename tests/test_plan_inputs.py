"""`ppsim plan`'s inputs and outputs around the search: the output format, the node layout, the time limit, and
tables printed whole when stdout is not a terminal (ppsim.plan, ppsim.cli.plan, ppsim.cli.output)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()


# --- tables piped or redirected print whole ---------------------------------------------------------------------
@pytest.mark.parametrize("env", [{}, {"COLUMNS": "40"}])
def test_a_table_piped_or_redirected_prints_whole_names_and_column_heads(env: dict[str, str]) -> None:
    """CliRunner's stdout is not a terminal (as `> plan.txt`): no "Interleaved…", no "sched…", no name cut in two."""
    result = runner.invoke(app, ["simulate", "-s", "Interleaved1F1B,InterleavedZeroBubble,ZBVZeroBubble", "-r", "4",
                                 "-m", "8"], env=env)
    assert result.exit_code == 0, result.output
    for word in ("InterleavedZeroBubble", "Interleaved1F1B", "ZBVZeroBubble", "schedule", "makespan", "bubble",
                 "peak act.", "peak bytes"):
        assert word in result.stdout
    assert "…" not in result.stdout


def test_the_plan_table_piped_prints_every_schedule_name_and_column_head_whole(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.cli.plan import print_plan
    from tests.test_plan import _plan, _request

    monkeypatch.setenv("COLUMNS", "60")
    print_plan(_plan(_request(top=50)))
    out = capsys.readouterr().out
    for word in ("InterleavedZeroBubble", "Interleaved1F1B", "schedule", "peak GiB", "rel. step"):
        assert word in out
    assert "…" not in out
