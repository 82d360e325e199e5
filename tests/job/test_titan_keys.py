"""torchtitan job keys: both generations (0.3.0's and the renamed ones after it) read the same, and a job's
errors and warnings speak in the job's own keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import TorchtitanConfigError
from ppsim.job.pipeline import job_from_settings
from ppsim.job.settings import NEW_KEYS, OLD_KEYS, JobSettings

runner = CliRunner()


def old_job(*, degree: int, schedule: str, microbatches: int, mb_size: int, seq_len: int) -> str:
    return (f'[parallelism]\npipeline_parallel_degree = {degree}\npipeline_parallel_schedule = "{schedule}"\n'
            f"pipeline_parallel_microbatch_size = {mb_size}\n"
            f"[training]\nlocal_batch_size = {microbatches * mb_size}\nseq_len = {seq_len}\n")


def new_job(*, degree: int, schedule: str, microbatches: int, mb_size: int, seq_len: int) -> str:
    return (f'[parallelism]\npipeline_parallel_degree = {degree}\npipeline_parallel_schedule = "{schedule}"\n'
            f"num_pp_microbatches = {microbatches}\n"
            f"[training]\nnum_tokens_per_microbatch_per_dp_rank = {mb_size * seq_len}\n"
            f"max_context_length = {seq_len}\n")


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "GPipe"])
def test_a_job_with_the_new_key_names_and_one_with_the_old_give_the_same_simulated_pipeline(
    tmp_path: Path, schedule: str
) -> None:
    shape = dict(degree=2, schedule=schedule, microbatches=6, mb_size=2, seq_len=64)
    outputs = []
    for name, text in (("old.toml", old_job(**shape)), ("new.toml", new_job(**shape))):
        path = tmp_path / name
        path.write_text(text)
        result = runner.invoke(app, ["simulate", "--torchtitan-config", str(path), "--json"])
        assert result.exit_code == 0, result.output
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1]
    assert outputs[0]["ranks"] == 2


@given(microbatches=st.integers(1, 64), mb_size=st.integers(1, 16), seq_len=st.integers(1, 8192))
def test_both_generations_of_batch_keys_read_the_same_microbatches(microbatches: int, mb_size: int,
                                                                   seq_len: int) -> None:
    old = JobSettings(source="old", parallelism={"pipeline_parallel_degree": 2,
                                                 "pipeline_parallel_microbatch_size": mb_size},
                      training={"local_batch_size": microbatches * mb_size, "seq_len": seq_len})
    new = JobSettings(source="new", parallelism={"pipeline_parallel_degree": 2, "num_pp_microbatches": microbatches},
                      training={"num_tokens_per_microbatch_per_dp_rank": mb_size * seq_len,
                                "max_context_length": seq_len})
    a, b = job_from_settings(old), job_from_settings(new)
    assert (a.batch_keys, b.batch_keys) == (OLD_KEYS, NEW_KEYS)
    assert dataclasses.replace(a, source="", batch_keys=NEW_KEYS) == dataclasses.replace(b, source="")
    assert (b.num_microbatches, b.microbatch_size, b.local_batch_size, b.seq_len) == (
        microbatches, mb_size, microbatches * mb_size, seq_len)


def test_a_job_mixing_the_two_generations_of_batch_keys_is_refused_naming_both() -> None:
    settings = JobSettings(source="job.toml", parallelism={"pipeline_parallel_degree": 2, "num_pp_microbatches": 4},
                           training={"local_batch_size": 8})
    with pytest.raises(TorchtitanConfigError, match=r"training\.local_batch_size.*parallelism\.num_pp_microbatches"
                                                    r".*keep one generation") as info:
        job_from_settings(settings)
    assert "\n" not in str(info.value)


def test_tokens_that_are_not_whole_sequences_are_refused_in_the_new_keys() -> None:
    settings = JobSettings(source="job.toml", parallelism={"pipeline_parallel_degree": 2},
                           training={"num_tokens_per_microbatch_per_dp_rank": 100, "max_context_length": 64})
    with pytest.raises(TorchtitanConfigError, match="num_tokens_per_microbatch_per_dp_rank 100 is not a multiple of "
                                                    "max_context_length 64"):
        job_from_settings(settings)


def test_a_schedule_refusal_names_the_jobs_own_batch_keys() -> None:
    # 1F1B with fewer microbatches than ranks cannot run; the fix names the keys the job uses
    settings = JobSettings(source="m:c", parallelism={"pipeline_parallel_degree": 4, "num_pp_microbatches": 2,
                                                      "pipeline_parallel_schedule": "Interleaved1F1B"},
                           training={"num_tokens_per_microbatch_per_dp_rank": 64, "max_context_length": 64},
                           in_file=False)
    job = job_from_settings(settings)
    text = str(job.refusal(ValueError("-m 2: Interleaved1F1B needs at least 4 microbatches")))
    assert "num_pp_microbatches 2" in text and "--parallelism.num_pp_microbatches" in text
    assert "local_batch_size" not in text


# --- config objects of each naming (a config function's Trainer.Config), read with torchtitan's machinery --------
@dataclasses.dataclass
class _OldParallelism:
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_microbatch_size: int = 1


@dataclasses.dataclass
class _OldTraining:
    local_batch_size: int = 8
    seq_len: int = 2048


@dataclasses.dataclass
class _NewParallelism:
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"
    num_pp_microbatches: int = 1


@dataclasses.dataclass
class _NewTraining:
    num_tokens_per_microbatch_per_dp_rank: int = 16384
    max_context_length: int = 2048


@dataclasses.dataclass
class _Config:
    parallelism: object
    training: object


@pytest.mark.torch
def test_config_objects_of_either_naming_give_the_same_pipeline_with_tyro_overrides() -> None:
    pytest.importorskip("torchtitan.config.manager")
    from ppsim.calibrate.torchtitan.config import settings_of_config

    old = settings_of_config("old:cfg", _Config(_OldParallelism(), _OldTraining()),
                             ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                              "Interleaved1F1B", "--training.local-batch-size=12",
                              "--parallelism.pipeline_parallel_microbatch_size", "3", "--training.seq_len", "32"])
    new = settings_of_config("new:cfg", _Config(_NewParallelism(), _NewTraining()),
                             ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                              "Interleaved1F1B", "--parallelism.num-pp-microbatches=4",
                              "--training.num_tokens_per_microbatch_per_dp_rank", "96",
                              "--training.max_context_length", "32"])
    a, b = job_from_settings(old), job_from_settings(new)
    assert (a.num_ranks, a.num_microbatches, a.microbatch_size, a.seq_len, a.stages_per_rank) == (2, 4, 3, 32, 2)
    assert dataclasses.replace(a, source="", batch_keys=NEW_KEYS) == dataclasses.replace(b, source="")


@pytest.mark.torch
def test_a_mistyped_override_of_a_config_object_is_one_line_from_torchtitans_parser() -> None:
    pytest.importorskip("torchtitan.config.manager")
    from ppsim.calibrate.torchtitan.config import settings_of_config

    with pytest.raises(TorchtitanConfigError,
                       match=r"--parallelism\.num-pp-microbatches 'four': not an integer") as info:
        settings_of_config("new:cfg", _Config(_NewParallelism(), _NewTraining()),
                           ["--parallelism.num_pp_microbatches", "four"])
    assert "\n" not in str(info.value)
    with pytest.raises(TorchtitanConfigError, match="did you mean --parallelism.num_pp_microbatches"):
        settings_of_config("new:cfg", _Config(_NewParallelism(), _NewTraining()),
                           ["--parallelism.num_pp_microbatchs", "4"])


def test_the_schedule_builder_call_adapts_to_the_signature_it_finds() -> None:
    from types import SimpleNamespace

    from ppsim.calibrate.torchtitan.runner import schedule_arguments

    def build_new(*, parallelism: object, num_microbatches: int, stages: list, loss_fn: object) -> None: ...

    def build_old(*, parallelism: object, local_batch_size: int, stages: list, loss_fn: object) -> None: ...

    config, count = schedule_arguments(SimpleNamespace(_build_pipeline_schedule=build_new), _NewParallelism,
                                       num_microbatches=6, mb_size=2, pipeline_parallel_degree=2)
    assert count == {"num_microbatches": 6} and config == _NewParallelism(pipeline_parallel_degree=2,
                                                                         num_pp_microbatches=6)
    config, count = schedule_arguments(SimpleNamespace(_build_pipeline_schedule=build_old), _OldParallelism,
                                       num_microbatches=6, mb_size=2, pipeline_parallel_degree=2)
    assert count == {"local_batch_size": 12} and config == _OldParallelism(pipeline_parallel_degree=2,
                                                                          pipeline_parallel_microbatch_size=2)
