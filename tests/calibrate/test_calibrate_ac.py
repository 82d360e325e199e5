"""Calibration under torchtitan's activation checkpointing (`calibrate --activation-checkpoint`): the option's
refusals, the profile's ``activation_checkpoint`` (absent: none; I and W null), the schedules such a profile cannot
time, the unit wrapped exactly as `run` wraps a model part (structural facts, never a timed assert), and `run` /
`simulate --torchtitan-config` against a profile at the job's mode or another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from one_line import one_line_error
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
PROFILE = DATA / "llama3_debugmodel_s32.profile.json"  # torchtitan:llama3/debugmodel, measured without checkpointing
MOE = "torchtitan:deepseek_v3/debugmodel"


def _profile_at(tmp_path: Path, mode: str, *, null_split: bool = True) -> Path:
    """The llama3 debug profile as if measured under ``mode``: I and W null, as such a calibration leaves them."""
    doc = json.loads(PROFILE.read_text())
    doc["activation_checkpoint"] = mode
    if null_split:
        for part in (*doc["blocks"].values(), doc["stage_overhead"]):
            part["I"] = part["W"] = None
    path = tmp_path / f"{mode}.profile.json"
    path.write_text(json.dumps(doc))
    return path


# --- the option ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "says"), [
    (["--activation-checkpoint", "some"], "--activation-checkpoint some: one of none, selective, full"),
    (["--preset", "tiny", "--activation-checkpoint", "selective"], "torchtitan's checkpointing wraps a torchtitan"),
])
def test_calibrate_activation_checkpoint_that_cannot_be_measured_is_one_line(tmp_path: Path, args: list[str],
                                                                            says: str) -> None:
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["calibrate", *args, "-o", str(out)])
    assert says in one_line_error(result)
    assert not out.exists() and not list(tmp_path.iterdir())


# --- the profile --------------------------------------------------------------------------------------------------
def test_a_profiles_mode_round_trips_with_null_split_backward_and_is_none_when_absent(tmp_path: Path) -> None:
    from ppsim.profile import load_profile

    old = load_profile(PROFILE)
    assert old.activation_checkpoint == "none" and "activation_checkpoint" not in old.to_dict()
    sac = load_profile(_profile_at(tmp_path, "selective"))
    assert sac.activation_checkpoint == "selective" and sac.to_dict()["activation_checkpoint"] == "selective"
    assert sac.blocks is not None and sac.blocks["layer"].I is None and sac.ops_measured == ("F", "B", "FB")


def test_a_profile_without_checkpointing_still_needs_its_i_and_w(tmp_path: Path) -> None:
    from ppsim.errors import CostError
    from ppsim.profile import load_profile

    path = _profile_at(tmp_path, "none")
    with pytest.raises(CostError, match=r"blocks\.\w+\.I is not measured"):
        load_profile(path)
    doc = json.loads(PROFILE.read_text())
    doc["activation_checkpoint"] = "partial"
    path.write_text(json.dumps(doc))
    with pytest.raises(CostError, match="activation_checkpoint must be one of none, selective, full"):
        load_profile(path)


def test_simulate_a_split_backward_schedule_with_a_checkpointed_profile_is_one_line(tmp_path: Path) -> None:
    path = _profile_at(tmp_path, "selective")
    refused = runner.invoke(app, ["simulate", "-s", "ZBH1", "-r", "2", "-m", "4", "--profile", str(path)])
    line = one_line_error(refused)
    assert "measured under activation_checkpoint selective" in line and "ZBH1 splits it into I and W" in line
    ok = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", str(path), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["makespan"] > 0


def test_the_predicted_step_recomputes_under_full_only_with_costs_measured_without_it() -> None:
    from ppsim.calibrate.execute.run import RunOptions, _predicted_recompute, ac_mismatch
    from ppsim.schedules import get_schedule

    schedule = get_schedule("1F1B", 2, 4)
    full = RunOptions(schedule="1F1B", activation_checkpoint="full")
    every = _predicted_recompute(full, schedule, frozenset(), measured_ac="none")
    assert len(every) == schedule.num_stages * schedule.num_microbatches
    assert _predicted_recompute(full, schedule, frozenset(), measured_ac="full") == frozenset()  # in B already
    assert _predicted_recompute(full, schedule, frozenset(), measured_ac="selective") == frozenset()
    assert ac_mismatch(full, "full") is None
    assert "every forward's rerun added" in (ac_mismatch(full, "none") or "")
    sac = RunOptions(schedule="1F1B", activation_checkpoint="selective", profile=Path("p.json"))
    line = ac_mismatch(sac, "none")
    assert line is not None and "p.json was measured under activation_checkpoint none, the job runs selective" in line
    assert "a lower bound" in line
    assert "an upper bound" in (ac_mismatch(RunOptions(schedule="1F1B", profile=Path("p.json")), "full") or "")


# --- torch: the unit wrapped as run wraps a model part ------------------------------------------------------------
@pytest.mark.torch
def test_a_unit_timed_under_selective_is_wrapped_and_reruns_its_forward_in_backward() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    from ppsim.calibrate.measure import harness
    from ppsim.calibrate.models import ModelOptions, parse_model_source
    from ppsim.calibrate.torchtitan.checkpointing import count_wrapped

    torch.set_num_threads(1)
    source = parse_model_source("torchtitan:llama3/debugmodel", ModelOptions(seq_len=32, layers=2, mb_size=1,
                                                                               dtype="float32"))
    unit = harness.unit_of("layers1", (0,))
    bench = harness.StageBench(source.config, 4, 1, device=torch.device("cpu"), unit=unit, source=source)
    timings, memories = harness.measure_benches([bench], warmup=0, reps=1, activation_checkpoint="selective")
    assert set(timings[0]) == {"F", "B", "FB"} and memories[0].activation_bytes > 0  # memory: unwrapped
    assert count_wrapped(bench.module) == 1
    calls: list[int] = []
    block = bench.module.layers["0"]._checkpoint_wrapped_module
    block.register_forward_hook(lambda *_: calls.append(1))
    bench.backward(bench.forward())
    assert len(calls) == 2  # its forward, and the backward's rerun of what the policy did not save


@pytest.mark.torch
def test_calibrate_under_selective_records_the_mode_and_leaves_i_and_w_unmeasured(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    from ppsim.profile import load_profile

    out = tmp_path / "sac.json"
    result = runner.invoke(app, ["calibrate", "--model", "torchtitan:llama3/debugmodel", "--seq-len", "32",
                                 "--layers", "2", "--dtype", "float32", "--reps", "1", "--warmup", "0", "--no-probe",
                                 "--no-p2p", "--activation-checkpoint", "selective", "-o", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.activation_checkpoint == "selective" and profile.complete
    assert profile.blocks is not None
    for block in profile.blocks.values():
        assert block.I is None and block.W is None and block.B is not None and block.FB is not None
    assert any(n.startswith("activation_checkpoint selective: each unit's blocks wrapped") for n in profile.notes)


@pytest.mark.torch
def test_simulate_a_selective_job_names_a_profile_measured_without_it(tmp_path: Path) -> None:
    """llama3_debugmodel's config checkpoints selectively: a profile measured under none is a lower bound (one
    warning line naming both modes); one measured under selective is used as it is."""
    pytest.importorskip("torchtitan.models")
    args = ["simulate", "--torchtitan-config", "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree",
            "2", "--training.seq_len", "32"]
    none = runner.invoke(app, [*args, "--profile", str(PROFILE)])
    assert none.exit_code == 0, none.output
    said = [ln for ln in none.stderr.splitlines() if "activation_checkpoint none, the job runs selective" in ln]
    assert len(said) == 1 and said[0].startswith("warning: ") and "a lower bound" in said[0]
    sac = runner.invoke(app, [*args, "--profile", str(_profile_at(tmp_path, "selective"))])
    assert sac.exit_code == 0, sac.output
    assert "activation_checkpoint" not in sac.stderr


# --- slow: calibrate the MoE debug flavor under selective at EP 2, then run with it -------------------------------
@pytest.mark.torch
@pytest.mark.slow
def test_a_sac_run_with_a_profile_calibrated_under_sac_predicts_from_it(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="needs the torchtitan extra")
    profile = tmp_path / "sac.json"
    result = runner.invoke(app, ["calibrate", "--model", MOE, "--seq-len", "32", "--dtype", "float32", "--ep", "2",
                                 "--reps", "2", "--warmup", "1", "--no-probe", "--activation-checkpoint", "selective",
                                 "-o", str(profile)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "run.json"
    run = runner.invoke(app, ["run", "-s", "GPipe", "-r", "2", "-m", "2", "--model", MOE, "--seq-len", "32",
                              "--dp-shard", "2", "--ep", "2", "--activation-checkpoint", "selective", "--profile",
                              str(profile), "--steps", "1", "--warmup", "1", "--probes", "0", "--timeout", "400",
                              "-o", str(out)])
    assert run.exit_code == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["grad_ok"]
    notes = data["prediction_inputs"]["notes"]
    assert not [n for n in notes if "lower bound" in n or "activation_checkpoint" in n], notes
    assert "activation_checkpoint" not in run.stderr
