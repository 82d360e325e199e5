"""One calibration of several tensor-parallel degrees and microbatch sizes: one profile whose passes `simulate` picks
by the job's degree and `plan` times (ppsim.profile entries, ppsim.cli.calibrate lists, ppsim.cli.plan covers)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import CostError
from ppsim.profile import Profile, load_profile

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = DATA / "llama3_debugmodel_s32.profile.json"
JOB = ["--torchtitan-config", "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2"]


def _scaled(blocks: dict[str, Any], factor: float) -> dict[str, Any]:
    out = copy.deepcopy(blocks)
    for block in out.values():
        for stat in block.values():
            if isinstance(stat, dict) and "median" in stat:
                for key in ("median", "p10", "p90"):
                    stat[key] *= factor
                stat["samples"] = [x * factor for x in stat.get("samples") or []] or stat.get("samples")
    return out


def _two_degrees(tmp_path: Path, *, mb_sizes: tuple[int, ...] = (1,)) -> Path:
    """The test profile with passes at TP 2 (layers half as long) beside its own TP 1 pass."""
    doc = json.loads(PROFILE.read_text())
    doc["entries"] = [{"tensor_parallel_degree": tp, "mb_size": mb, "blocks": _scaled(doc["blocks"], 0.5 * mb),
                       "stage_overhead": doc["stage_overhead"]}
                      for tp in (1, 2) for mb in mb_sizes if (tp, mb) != (1, doc["model"]["mb_size"])]
    path = tmp_path / "tp12.profile.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_profile_of_several_passes_round_trips_and_each_pass_reads_as_a_profile(tmp_path: Path) -> None:
    profile = load_profile(_two_degrees(tmp_path, mb_sizes=(1, 2)))
    assert profile.covers == ((1, 1), (1, 2), (2, 1), (2, 2)) and profile.tensor_parallel_degrees == (1, 2)
    assert Profile.from_dict(profile.to_dict()) == profile
    tp2 = profile.entry(tp=2, mb_size=2)
    assert (tp2.tensor_parallel_degree, tp2.model.mb_size, tp2.entries) == (2, 2, ())
    assert tp2.blocks["layer"].F.median == pytest.approx(profile.blocks["layer"].F.median)  # 0.5 x 2
    assert profile.entry(tp=2).model.mb_size == 1  # no size asked: the first at that degree
    assert profile.entry(tp=1, mb_size=1).blocks == profile.blocks
    assert load_profile(PROFILE).entry(tp=1) == load_profile(PROFILE)  # one pass: itself


def test_a_degree_the_profile_lacks_names_the_degrees_it_has(tmp_path: Path) -> None:
    with pytest.raises(CostError, match=r"measured at tensor_parallel_degree 1 and 2, the job runs 4"):
        load_profile(_two_degrees(tmp_path)).entry(tp=4, source="P")


def test_a_pass_measured_twice_is_one_line(tmp_path: Path) -> None:
    doc = json.loads(_two_degrees(tmp_path).read_text())
    doc["entries"].append(doc["entries"][0])
    with pytest.raises(CostError, match=r"entries\[1\] measures tensor_parallel_degree 2 and mb_size 1 again"):
        Profile.from_dict(doc)


@pytest.mark.parametrize(("args", "expected"), [
    (["--tp", "1,2,2"], "--tp 1,2,2: 2 is given twice"),
    (["--tp", "1,-2"], "--tp 1,-2: must be at least 1 (got -2)"),
    (["--tp", "1,two"], "--tp 1,two: 'two' is not an integer"),
    (["--mb-size", "1,1"], "--mb-size 1,1: 1 is given twice"),
    (["--mb-size", "0,1"], "--mb-size 0,1: must be at least 1 (got 0)"),
])
def test_bad_lists_are_one_line_before_anything_starts(tmp_path: Path, args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), *args])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and expected in errors[0], result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.torch
def test_a_degree_of_the_list_that_does_not_divide_the_heads_is_named(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models")
    result = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), "--model",
                                 "torchtitan:llama3/debugmodel", "--tp", "1,2,3"])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "--tp 1,2,3: degree 3 does not divide the 16 attention heads" in errors[0]


def _makespan(args: list[str]) -> float:
    result = runner.invoke(app, ["simulate", *JOB, *args, "--json"])
    assert result.exit_code == 0, result.output
    return float(json.loads(result.stdout)["makespan"])


@pytest.mark.torch
def test_simulate_picks_the_pass_at_the_jobs_degree_and_refuses_one_it_lacks(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models")
    path = _two_degrees(tmp_path)
    tp1 = _makespan(["--profile", str(path)])
    assert tp1 == pytest.approx(_makespan(["--profile", str(PROFILE)]))  # the profile's own pass, as before
    tp2 = _makespan(["--profile", str(path), "--parallelism.tensor_parallel_degree", "2"])
    assert tp2 < 0.8 * tp1  # the TP 2 pass's layers take half as long
    result = runner.invoke(app, ["simulate", *JOB, "--profile", str(path),
                                 "--parallelism.tensor_parallel_degree", "4"])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "measured at tensor_parallel_degree 1 and 2, the job runs 4" in errors[0]


@pytest.mark.torch
def test_plan_refuses_a_pinned_degree_the_profile_lacks(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models")
    result = runner.invoke(app, ["plan", *JOB, "--gpus", "8", "--memory-cap", "8GiB", "--profile",
                                 str(_two_degrees(tmp_path)), "--parallelism.tensor_parallel_degree", "4"])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "measured tensor_parallel_degree 1 and 2, not 4" in errors[0], result.output


@pytest.mark.torch
@pytest.mark.slow
def test_one_calibration_at_tp_1_and_2_times_both_degrees_in_plan(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.models")
    path = tmp_path / "tp12.json"
    result = runner.invoke(app, ["calibrate", "-o", str(path), "--model", "torchtitan:llama3/debugmodel",
                                 "--tp", "1,2", "--seq-len", "16", "--mb-size", "1", "--dtype", "float32",
                                 "--reps", "2", "--warmup", "0", "--no-p2p", "--no-probe"])
    assert result.exit_code == 0, result.output
    assert "pass 1/2: tp 1, microbatch size 1" in result.output and "pass 2/2: tp 2" in result.output
    profile = load_profile(path)
    assert profile.covers == ((1, 1), (2, 1))
    whole, half = profile.blocks["layer"].param_bytes, profile.entry(tp=2).blocks["layer"].param_bytes
    assert half < 0.6 * whole  # one rank's shards
    plan = runner.invoke(app, ["plan", *JOB, "--gpus", "4", "--memory-cap", "8GiB", "--profile", str(path),
                               "--training.seq_len", "16", "--parallelism.pipeline_parallel_schedule", "1F1B",
                               "--time-limit", "25", "--json"])
    assert plan.exit_code == 0, plan.output
    timed = {c["tp"] for c in json.loads(plan.stdout)["candidates"] if c["step_s"] is not None}
    assert timed == {1, 2}, plan.output


@pytest.mark.torch
def test_tensor_parallel_units_run_their_collectives_in_torchtitans_spmd_context() -> None:
    """torchtitan's default spmd_types layers run no collective outside the trainer's SPMD context: a TP unit timed
    there would leave its communication out. Inside it, forward and backward gather and scatter the sequence."""
    pytest.importorskip("torchtitan.models")
    from tp_collectives import forward_collectives

    from ppsim.calibrate.execute.launch import run_local

    seen = run_local(forward_collectives, (), world_size=2, timeout_s=120, what="the TP unit check")
    assert seen["outside"] == 0, seen  # what calibration measured before
    assert seen["inside"] >= 4, seen  # all-gather and reduce-scatter, forward and backward
    assert seen["inside_tokens"] == 16 // 2  # sequence parallel: each rank's shard of the tokens
