"""A torchtitan job's refusals and warnings speak in the job's own keys, and a job that torchtitan could not run is
refused rather than simulated (issue 26, items 15 and 16)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
PROFILE = str(Path(__file__).parents[1] / "data" / "llama3_debugmodel_s32.profile.json")  # a 6-layer model


def simulate(tmp_path: Path, parallelism: str, *extra: str, batch: int = 8) -> tuple[int, str]:
    path = tmp_path / "job.toml"
    path.write_text(f'[parallelism]\npipeline_parallel_degree = 2\n{parallelism}\n[training]\nseq_len = 32\n'
                    f"local_batch_size = {batch}\n")
    result = runner.invoke(app, ["simulate", "--torchtitan-config", str(path), *extra])
    return result.exit_code, result.stderr


def test_a_single_stage_schedule_class_with_a_csv_of_two_stages_per_rank_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    csv = tmp_path / "two_per_rank.csv"
    csv.write_text("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n")
    code, err = simulate(tmp_path, f'pipeline_parallel_schedule = "PipelineScheduleSingle"\n'
                                   f'pipeline_parallel_schedule_csv = "{csv}"')
    assert code == 2 and err.count("\n") == 1, err
    assert "'PipelineScheduleSingle' builds one stage per rank" in err and f"{csv}" in err
    assert "holds 2 on rank 0 (stages 0, 2)" in err


def test_a_multi_stage_schedule_class_with_the_same_csv_is_simulated(tmp_path: Path) -> None:
    csv = tmp_path / "two_per_rank.csv"
    csv.write_text("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n")
    code, err = simulate(tmp_path, f'pipeline_parallel_schedule = "PipelineScheduleMulti"\n'
                                   f'pipeline_parallel_schedule_csv = "{csv}"', batch=1)
    assert code == 0, err


def test_a_huge_first_stage_weight_is_named_by_the_jobs_key_not_an_internal_option(tmp_path: Path) -> None:
    code, err = simulate(tmp_path, 'pipeline_parallel_schedule = "Interleaved1F1B"\n'
                                   "pipeline_parallel_first_stage_less_layers = 1000000", "--profile", PROFILE)
    assert code == 2 and err.count("\n") == 1, err
    assert "parallelism.pipeline_parallel_first_stage_less_layers = 1000000" in err
    assert "input_weight" not in err and "change pipeline_parallel_first_stage_less_layers in the file" in err


def test_an_empty_module_list_part_is_named_by_the_jobs_key_not_as_a_split(tmp_path: Path) -> None:
    parts = ('[["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"], [], ["layers.4", "layers.5"], '
             '["norm", "output"]]')
    code, err = simulate(tmp_path, f'pipeline_parallel_schedule = "Interleaved1F1B"\n'
                                   f"module_fqns_per_model_part = {parts}", "--profile", PROFILE)
    assert code == 2 and err.count("\n") == 1, err
    assert "parallelism.module_fqns_per_model_part part 1 holds no layers.N" in err and "--split" not in err.split(";")[0]


@pytest.mark.parametrize("same", [True, False])
def test_a_job_giving_both_spellings_of_the_module_list_key_is_told_which_was_used(tmp_path: Path,
                                                                                  same: bool) -> None:
    used = '[["tok_embeddings", "layers.0", "layers.1"], ["layers.2"], ["layers.3"], ["layers.4", "layers.5", "norm", "output"]]'
    other = used if same else ('[["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4"], '
                               '["layers.5", "norm", "output"]]')
    code, err = simulate(tmp_path, f'pipeline_parallel_schedule = "Interleaved1F1B"\nmodule_fqns_per_model_part = '
                                   f"{used}\npipeline_parallel_module_fqns_per_model_part = {other}",
                         "--profile", PROFILE)
    assert code == 0, err
    assert ("parallelism.module_fqns_per_model_part and parallelism.pipeline_parallel_module_fqns_per_model_part are "
            f"both given ({'the same' if same else 'different'} lists): ppsim uses module_fqns_per_model_part") in err
