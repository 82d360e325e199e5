"""`ppsim run` of an order with recomputation: torch's checkpointing on the chosen (stage, microbatch), gradients
still equal to the non-pipelined reference, and the prediction simulated with the same set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_run import FAST, check_run_json, invoke, write_profile  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from ppsim.cli import app  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def simulate_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["simulate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_full_recompute_runs_with_checkpointing_and_matches_the_reference(tmp_path: Path, schedule: str) -> None:
    profile = write_profile(tmp_path / "p.json", 2)
    plain, rc = tmp_path / "plain.json", tmp_path / "rc.json"
    printed = {}
    for out, mode in ((plain, "none"), (rc, "full")):
        code, printed[mode], stderr = invoke("-s", schedule, "-r", "2", "-m", "4", "--profile", str(profile), "-o",
                                             str(out), "--recompute", mode, *FAST)
        assert code == 0, stderr
    # the hooks do not see a recomputing backward's re-materialised activations: that row carries no error, and says so
    from ppsim.cli.run import RECOMPUTED_ACTIVATIONS

    assert RECOMPUTED_ACTIVATIONS[:40] in printed["full"] and "peak activations *" in printed["full"]
    assert RECOMPUTED_ACTIVATIONS[:40] not in printed["none"]
    data, base = check_run_json(rc, schedule, 2, 4), check_run_json(plain, schedule, 2, 4)
    assert data["grad_max_abs_diff"] <= data["grad_tolerance"] and data["loss_match"]
    assert len(data["recompute"]) == 8 and "recompute" not in base
    # the prediction is simulate's with the same set: each B (or I) takes its stage's F longer
    sim = simulate_json("-s", schedule, "-r", "2", "-m", "4", "--profile", str(profile), "--recompute", "full")
    assert data["predicted_step_s"] == pytest.approx(sim["makespan"], rel=1e-12)
    assert data["predicted_step_s"] > base["predicted_step_s"]
    # torch's checkpoint keeps only each stage's inputs: what the saved-tensor hooks see shrinks
    for m, b in zip(data["memory"], base["memory"]):
        assert m["peak_activation_bytes_measured"] < b["peak_activation_bytes_measured"]


def test_a_searched_order_runs_with_the_set_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "best.csv"
    res = CliRunner().invoke(app, ["search", "-r", "2", "-m", "4", "--memory-cap", "1.2act", "--recompute", "auto",
                                   "--time-limit", "1", "--max-orders", "40", "--solver", "none", "-q", "-o",
                                   str(out)])
    assert res.exit_code == 0, res.output
    chosen = json.loads(out.with_name("best.recompute.json").read_text())["recompute"]
    profile = write_profile(tmp_path / "p.json", 2)
    run_json = tmp_path / "run.json"
    code, _, stderr = invoke("-s", str(out), "--profile", str(profile), "-o", str(run_json), *FAST)
    assert code == 0, stderr
    data = json.loads(run_json.read_text())
    assert data["grad_ok"] and data["loss_match"]
    assert data["recompute"] == chosen


def test_recompute_with_synthetic_stages_is_refused_in_one_line() -> None:
    code, _, stderr = invoke("-s", "1F1B", "-r", "2", "-m", "2", "--synthetic", "--recompute", "full")
    assert code == 2 and "drop --synthetic" in stderr
