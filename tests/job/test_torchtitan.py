"""torchtitan job configs: ppsim simulates exactly the pipeline torchtitan would build from the TOML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from profile_v2 import make_v2_profile
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import TorchtitanConfigError
from ppsim.job.pipeline import load_torchtitan_job
from ppsim.profile import save_profile
from ppsim.split import SplitSpec


def toml(tmp_path: Path, parallelism: str, training: str = "local_batch_size = 8", name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(f"[job]\ndescription = \"test\"\n\n[parallelism]\n{parallelism}\n\n[training]\n{training}\n")
    return path


def test_named_schedule_ranks_and_microbatches_come_from_the_file(tmp_path: Path) -> None:
    path = toml(tmp_path, 'pipeline_parallel_degree = 4\npipeline_parallel_schedule = "interleaved1f1b"\n'
                          "pipeline_parallel_microbatch_size = 2", "local_batch_size = 16\nseq_len = 4")
    job = load_torchtitan_job(path)
    # torchtitan: a multi-stage schedule without layers_per_stage holds 2 stages per rank; 16 / 2 microbatches
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == ("Interleaved1F1B", 4, 8, 2)
    assert job.split == SplitSpec() and job.warnings == ()


def test_defaults_are_torchtitans(tmp_path: Path) -> None:
    job = load_torchtitan_job(toml(tmp_path, "pipeline_parallel_degree = 2", training=""))
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == ("1F1B", 2, 8, 1)
    assert job.seq_len == 2048


@pytest.mark.parametrize(
    ("schedule", "layers_per_stage", "stages_per_rank"),
    [("Interleaved1F1B", 2, 3), ("Interleaved1F1B", 3, 2), ("ZBVZeroBubble", 3, 2), ("1F1B", 5, 1)],
)
def test_layers_per_stage_sets_stages_per_rank_as_torchtitan(
    tmp_path: Path, schedule: str, layers_per_stage: int, stages_per_rank: int
) -> None:
    degree = 2
    path = toml(tmp_path, f'pipeline_parallel_degree = {degree}\npipeline_parallel_schedule = "{schedule}"\n'
                          f"pipeline_parallel_layers_per_stage = {layers_per_stage}")
    job = load_torchtitan_job(path, num_layers=8 if layers_per_stage != 2 else 10)
    assert job.stages_per_rank == stages_per_rank
    assert job.split.layers_per_stage == layers_per_stage


@pytest.mark.parametrize(
    ("parallelism", "needle"),
    [
        ("pipeline_parallel_degree = 0", "in 1..100000"),
        ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Nope"', "use one of"),
        ("pipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 3", "not divisible by"),
        ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "PipelineScheduleMulti"', "needs"),
        ('pipeline_parallel_degree = 2\npipeline_parallel_schedule_csv = "missing.csv"', "is not a file"),
        ("pipeline_parallel_degree = 2\npipeline_parallel_layers_per_stage = 4", "not divisible by"),
        ("pipeline_parallel_degree = 2\npipeline_parallel_layers_per_stage = 3", "holds one stage per rank"),
        ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
         "pipeline_parallel_layers_per_stage = 5", "at least 2 per rank"),
        ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "GPipe"\n'
         "pipeline_parallel_layers_per_stage = 1", "one stage per rank"),
        ("pipeline_parallel_degree = true", "must be an integer"),
        ("pipeline_parallel_degree = 2\npipeline_parallel_size = 4", "disagree"),
        ("pipeline_parallel_degree = [", "not valid TOML"),
    ],
)
def test_bad_configs_are_one_line(tmp_path: Path, parallelism: str, needle: str) -> None:
    with pytest.raises(TorchtitanConfigError) as info:
        load_torchtitan_job(toml(tmp_path, parallelism), num_layers=8)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_job_without_a_pipeline_is_its_gradient_accumulation_on_one_rank(tmp_path: Path) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 1\ndata_parallel_shard_degree = 4",
                "local_batch_size = 2\nglobal_batch_size = 24")
    job = load_torchtitan_job(path, num_layers=8)
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == ("1F1B", 1, 3, 1)
    assert job.microbatch_size == 2 and any("no pipeline" in w for w in job.warnings)
    with pytest.raises(TorchtitanConfigError, match="drop -s"):
        load_torchtitan_job(path, num_layers=8, schedule="Interleaved1F1B")
    odd = toml(tmp_path, "pipeline_parallel_degree = 1\ndata_parallel_shard_degree = 4",
               "local_batch_size = 2\nglobal_batch_size = 20", name="odd.toml")
    with pytest.raises(TorchtitanConfigError, match="not a multiple of local_batch_size 2 x data-parallel degree 4"):
        load_torchtitan_job(odd, num_layers=8)


def test_layers_per_stage_without_a_layer_count_asks_for_a_profile(tmp_path: Path) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 2\npipeline_parallel_layers_per_stage = 5")
    with pytest.raises(TorchtitanConfigError, match="--profile"):
        load_torchtitan_job(path)


def test_settings_ppsim_cannot_honour_are_named(tmp_path: Path) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 2\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = -1")
    job = load_torchtitan_job(path)
    text = " | ".join(job.warnings)
    assert "tensor_parallel_degree" in text
    assert "data_parallel_shard_degree" not in text


@pytest.mark.parametrize(
    ("parts", "needle"),
    [
        ([["tok_embeddings", "layers.1"], ["layers.0", "norm"]], "where layers.0 comes next"),
        ([["layers.0"], ["tok_embeddings", "layers.1", "norm", "output"]], "part 1 holds tok_embeddings"),
        ([["tok_embeddings", "layers.0", "norm"], ["layers.1", "output"]], "part 0 holds norm"),
        ([["tok_embeddings", "vision_encoder", "layers.0"], ["layers.1", "norm", "output"]], "'vision_encoder'"),
        ([["tok_embeddings", 3], ["layers.0", "norm"]], "not a module name"),
        ("tok_embeddings", "not a list of module-name lists"),
    ],
)
def test_module_lists_ppsim_cannot_simulate_are_refused_naming_the_key(
    tmp_path: Path, parts: object, needle: str
) -> None:
    """torchtitan would build these stages; ppsim would simulate another split, so it says so instead (issue 18)."""
    path = toml(tmp_path, f"pipeline_parallel_degree = 2\nmodule_fqns_per_model_part = {json.dumps(parts)}")
    with pytest.raises(TorchtitanConfigError) as info:
        load_torchtitan_job(path)
    text = str(info.value)
    assert "module_fqns_per_model_part" in text and needle in text and "\n" not in text


def test_module_lists_with_layers_per_stage_name_the_dropped_key(tmp_path: Path) -> None:
    parts = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    path = toml(tmp_path, "pipeline_parallel_degree = 2\npipeline_parallel_layers_per_stage = 3\n"
                          f"module_fqns_per_model_part = {json.dumps(parts)}")
    job = load_torchtitan_job(path, num_layers=4)
    assert job.split == SplitSpec(split=(2, 2))
    assert any("pipeline_parallel_layers_per_stage = 3 does not decide the split" in w for w in job.warnings)
    result = CliRunner().invoke(app, ["simulate", "--torchtitan-config", str(path), "--profile",
                                      str(save_profile(make_v2_profile(num_layers=4), tmp_path / "p.json"))])
    assert result.exit_code == 0, result.output
    assert "warning: parallelism.pipeline_parallel_layers_per_stage" in result.stderr


def test_microbatch_shape_differing_from_the_profile_is_named(tmp_path: Path) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 2", "local_batch_size = 8\nseq_len = 8192")
    job = load_torchtitan_job(path, model=make_v2_profile().model)
    assert any("seq_len 4" in w and "8192" in w for w in job.warnings)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [({"num_ranks": 4}, "-r/--ranks"), ({"num_microbatches": 3}, "-m/--mb"), ({"schedule": "ZBH1"}, "-s/--schedule"),
     ({"stages_per_rank": 3}, "-v/--stages-per-rank")],
)
def test_contradicting_the_command_line_is_one_line(tmp_path: Path, kwargs: dict, option: str) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 2")
    with pytest.raises(TorchtitanConfigError) as info:
        load_torchtitan_job(path, **kwargs)
    assert option in str(info.value) and "contradicts" in str(info.value)


def test_agreeing_command_line_values_are_accepted(tmp_path: Path) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 2")
    job = load_torchtitan_job(path, schedule="1f1b", num_ranks=2, num_microbatches=8, stages_per_rank=1)
    assert job.schedule == "1F1B"


def test_a_csv_schedule_is_loaded_as_torchtitan_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    csv = tmp_path / "sched.csv"
    assert runner.invoke(app, ["export", "-s", "1F1B", "-r", "2", "-m", "4", "-o", str(csv)]).exit_code == 0
    path = toml(tmp_path, 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "PipelineScheduleSingle"\n'
                          'pipeline_parallel_schedule_csv = "sched.csv"', "local_batch_size = 4")
    job = load_torchtitan_job(path)
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == ("sched.csv", 2, 4, None)
    result = runner.invoke(app, ["simulate", "--torchtitan-config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ranks"] == 2 and data["microbatches"] == 4


def test_cli_simulates_the_torchtitan_pipeline_with_a_v2_profile(tmp_path: Path) -> None:
    profile = save_profile(make_v2_profile(), tmp_path / "v2.json")
    path = toml(tmp_path, 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
                          "pipeline_parallel_layers_per_stage = 3", "local_batch_size = 8\nseq_len = 4")
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "--torchtitan-config", str(path), "--profile", str(profile), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schedule"] == "Interleaved1F1B" and data["ranks"] == 2 and data["microbatches"] == 8
    assert data["stages"] == 4 and data["stages_per_rank"] == 2
    direct = runner.invoke(app, ["simulate", "-s", "Interleaved1F1B", "-r", "2", "-m", "8", "--profile", str(profile),
                                 "--layers-per-stage", "3", "--json"])
    assert json.loads(direct.stdout)["makespan"] == data["makespan"]


def test_cli_contradiction_exits_2_with_one_line(tmp_path: Path) -> None:
    path = toml(tmp_path, "pipeline_parallel_degree = 2")
    result = CliRunner().invoke(app, ["simulate", "--torchtitan-config", str(path), "-r", "4"])
    assert result.exit_code == 2
    assert "contradicts" in result.output and result.output.count("\n") == 1


def test_explicit_module_lists_become_the_split(tmp_path: Path) -> None:
    parts = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3"], ["layers.4", "layers.5"],
             ["layers.6", "layers.7", "norm", "output"]]
    path = toml(tmp_path, 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
                          f"module_fqns_per_model_part = {json.dumps(parts)}")
    job = load_torchtitan_job(path, num_layers=8)
    assert job.split == SplitSpec(split=(1, 3, 2, 2)) and job.stages_per_rank == 2 and job.warnings == ()
    with pytest.raises(TorchtitanConfigError, match="holds 8 layers but the profile's model has 10"):
        load_torchtitan_job(path, num_layers=10)
