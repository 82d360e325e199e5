"""`ppsim calibrate` and `ppsim run` with ``--torchtitan-config`` (calibrate/torchtitan/job.py): the job gives the model and
its microbatch shape (run: also the schedule, ranks, microbatches and split); what the command line adds must agree.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.cli import app

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA_PROFILE = DATA / "llama3_debugmodel_s32.profile.json"
LLAMA = "llama3:llama3_debugmodel"
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"]
"""Two pipeline ranks; torchtitan 0.3.0 refuses a pipeline unless CUDA graphs are off."""
S32 = ["--training.seq_len", "32"]
"""The microbatch shape of tests/data/llama3_debugmodel_s32.profile.json (1 x 32)."""
FAST_RUN = ["--steps", "1", "--warmup", "1", "--probes", "0", "--timeout", "300"]


def has_torchtitan() -> bool:
    try:
        import torchtitan.distributed.pipeline_parallel  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchtitan = pytest.mark.skipif(not has_torchtitan(), reason="needs the torchtitan extra")


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def one_line_error(code: int, err: str, says: str) -> None:
    assert code == 2 and says in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("Error: "), err


def toml(tmp_path: Path, body: str = "") -> Path:
    path = tmp_path / "job.toml"
    path.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "1F1B"\n'
                    f"[training]\nlocal_batch_size = 4\nseq_len = 32\n{body}")
    return path


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------------------
def test_a_toml_job_names_no_model_so_calibrate_needs_model(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    code, _, err = invoke("calibrate", "--torchtitan-config", str(toml(tmp_path)), "-o", str(out))
    one_line_error(code, err, "names no model")
    assert "pass --model" in err and not out.exists()


def test_a_toml_job_with_a_model_table_names_its_model(tmp_path: Path) -> None:
    # an older release's TOML names its model in [model] (name, flavor): --model must agree with it
    out = tmp_path / "p.json"
    job = toml(tmp_path, '[model]\nname = "llama3"\nflavor = "debugmodel"\n')
    code, _, err = invoke("calibrate", "--torchtitan-config", str(job), "--model", "builtin:tiny", "-o", str(out))
    one_line_error(code, err, "whose model is torchtitan:llama3/debugmodel")
    assert not out.exists()
    bad = toml(tmp_path, '[model]\nname = "llama3; rm -rf"\nflavor = "debugmodel"\n')
    code, _, err = invoke("calibrate", "--torchtitan-config", str(bad), "-o", str(out))
    one_line_error(code, err, "is not a torchtitan model name and flavor")
    assert not out.exists()


def test_overrides_and_mistyped_options_of_calibrate_are_one_line(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    code, _, err = invoke("calibrate", "--parallelism.pipeline_parallel_degree", "2", "-o", str(out))
    one_line_error(code, err, "pass --torchtitan-config")
    code, _, err = invoke("calibrate", "--torchtitan-config", str(toml(tmp_path)), "--rep", "3", "-o", str(out))
    one_line_error(code, err, "did you mean --reps")
    code, _, err = invoke("run", "--torchtitan-config", str(toml(tmp_path)), "--trainig.seq_len", "8")
    one_line_error(code, err, "ppsim reads only --parallelism.KEY and --training.KEY")
    code, _, err = invoke("run")
    one_line_error(code, err, "--schedule/-s is required (or --torchtitan-config")
    assert not out.exists()


@needs_torchtitan
@pytest.mark.torch
@pytest.mark.parametrize(("extra", "says"), [
    (["--model", "torchtitan:deepseek_v3/debugmodel"],
     "--model torchtitan:deepseek_v3/debugmodel contradicts --torchtitan-config llama3:llama3_debugmodel, whose model "
     "is torchtitan:llama3/debugmodel"),
    (["--preset", "tiny"], "--preset tiny (builtin:tiny) contradicts"),
])
def test_calibrate_refuses_a_model_the_job_does_not_train(tmp_path: Path, extra: list[str], says: str) -> None:
    out = tmp_path / "p.json"
    code, _, err = invoke("calibrate", "--torchtitan-config", LLAMA, *S32, *extra, "-o", str(out))
    one_line_error(code, err, says)
    assert not out.exists()


@needs_torchtitan
@pytest.mark.torch
@pytest.mark.parametrize(("extra", "says"), [
    (["-r", "4"], "-r/--ranks 4 contradicts llama3:llama3_debugmodel, which gives 2; drop -r or pass "
                  "--parallelism.pipeline_parallel_degree VALUE"),
    (["-s", "1F1B"], "-s/--schedule 1F1B contradicts"),
    (["-m", "3"], "-m/--mb 3 contradicts"),
    (["--model", "builtin:tiny"], "contradicts --torchtitan-config"),
])
def test_run_refuses_options_that_contradict_the_job(tmp_path: Path, extra: list[str], says: str) -> None:
    out = tmp_path / "run.json"
    code, _, err = invoke("run", "--torchtitan-config", LLAMA, *PP2, *S32, "--profile", str(LLAMA_PROFILE), *extra,
                          "-o", str(out), *FAST_RUN)
    one_line_error(code, err, says)
    assert not out.exists()


@needs_torchtitan
@pytest.mark.torch
def test_run_refuses_a_profile_of_another_microbatch_shape(tmp_path: Path) -> None:
    code, _, err = invoke("run", "--torchtitan-config", LLAMA, *PP2, "--profile", str(LLAMA_PROFILE), *FAST_RUN)
    one_line_error(code, err, "measured at seq_len 32 x microbatch size 1 but --torchtitan-config "
                              "llama3:llama3_debugmodel runs 2048 x 1")
    assert "--training.seq_len 32" in err


@needs_torchtitan
@pytest.mark.torch
def test_a_debug_jobs_long_sequences_refused_by_the_estimate_name_the_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppsim.calibrate.execute import launch

    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 2**30)
    out = tmp_path / "p.json"
    code, _, err = invoke("calibrate", "--torchtitan-config", LLAMA, "--no-probe", "-o", str(out))
    one_line_error(code, err, "microbatch 1x2048) needs about")
    assert err.rstrip().endswith("the job's training.seq_len is 2048: e.g. --training.seq_len 128 lowers it")
    assert not out.exists()


@needs_torchtitan
@pytest.mark.torch
def test_a_run_too_large_for_this_machine_names_the_jobs_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.execute import launch

    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 2**20)
    out = tmp_path / "run.json"
    code, _, err = invoke("run", "--torchtitan-config", LLAMA, *PP2, *S32, "--profile", str(LLAMA_PROFILE),
                          "-o", str(out), *FAST_RUN)
    one_line_error(code, err, "Interleaved1F1B -r 2 -m 8: needs about")
    assert "(-r and -m come from --torchtitan-config llama3:llama3_debugmodel: pass " in err
    assert "--training.local_batch_size" in err and not out.exists()


# --- what the job gives (nothing built, nothing run) ---------------------------------------------------------------
@needs_torchtitan
@pytest.mark.torch
def test_calibration_takes_the_jobs_model_and_microbatch_shape() -> None:
    from ppsim.calibrate.models import ModelOptions
    from ppsim.calibrate.torchtitan.job import calibration_source

    source, notes = calibration_source(LLAMA, model=None, preset=None, options=ModelOptions())
    assert source.text == "torchtitan:llama3/debugmodel"
    assert (source.config.seq_len, source.config.mb_size) == (2048, 1) and notes == ()
    source, notes = calibration_source(LLAMA, ["--parallelism.pipeline_parallel_microbatch_size", "2", *S32],
                                       model="torchtitan:llama3/debugmodel", preset=None, options=ModelOptions())
    assert (source.config.seq_len, source.config.mb_size) == (32, 2) and notes == ()
    source, notes = calibration_source(LLAMA, S32, model=None, preset=None, options=ModelOptions(seq_len=16))
    assert source.config.seq_len == 16
    assert notes == ("note: --seq-len 16 replaces training.seq_len 32 of --torchtitan-config llama3:llama3_debugmodel",)


def test_a_toml_job_gives_its_shape_to_the_model_passed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ppsim.calibrate.models import ModelOptions
    from ppsim.calibrate.torchtitan.job import calibration_source

    source, _ = calibration_source(str(toml(tmp_path)), ["--parallelism.pipeline_parallel_microbatch_size", "2"],
                                   model="builtin:tiny", preset=None, options=ModelOptions())
    assert source.text == "builtin:tiny" and (source.config.seq_len, source.config.mb_size) == (32, 2)


@needs_torchtitan
@pytest.mark.torch
def test_run_reads_the_job_as_simulate_does() -> None:
    from ppsim.calibrate.models import ModelOptions
    from ppsim.calibrate.torchtitan.config import load_job
    from ppsim.calibrate.torchtitan.job import run_inputs

    overrides = [*PP2, *S32, "--training.local_batch_size", "4"]
    job = run_inputs(LLAMA, overrides, options=ModelOptions(), profile=LLAMA_PROFILE)
    simulated = load_job(LLAMA, overrides, num_layers=6)
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == (
        simulated.schedule, simulated.num_ranks, simulated.num_microbatches, simulated.stages_per_rank)
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == ("Interleaved1F1B", 2, 4, 2)
    assert job.source.text == "torchtitan:llama3/debugmodel"
    assert (job.source.options.seq_len, job.source.options.mb_size) == (32, 1)
    assert job.split is None  # torchtitan's default split, which ppsim's default is
    parts = ["tok_embeddings,layers.0,layers.1,layers.2", "layers.3", "layers.4", "layers.5,norm,lm_head"]
    job = run_inputs(LLAMA, [*overrides, "--parallelism.module_fqns_per_model_part", *parts],
                     options=ModelOptions(), profile=LLAMA_PROFILE)
    assert job.split == "3,1,1,1"
    job = run_inputs(LLAMA, [*overrides, "--parallelism.pipeline_parallel_schedule", "1F1B",
                             "--parallelism.pipeline_parallel_first_stage_less_layers", "3"],
                     options=ModelOptions(), profile=LLAMA_PROFILE)
    assert job.stages_per_rank == 1 and job.split == "2,4"  # the embedding weighs 3 layers: (3 + 6 + 1) / 2 stages


# --- end to end: calibrate the job's model, then run the job --------------------------------------------------------
@needs_torchtitan
@pytest.mark.torch
@pytest.mark.slow
def test_calibrate_then_run_a_config_function(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    code, _, err = invoke("calibrate", "--torchtitan-config", LLAMA, *S32, "--reps", "3", "--warmup", "1",
                          "--no-p2p", "--no-probe", "-o", str(profile))
    assert code == 0, err
    prof = json.loads(profile.read_text())
    assert prof["source"]["source"] == "torchtitan:llama3/debugmodel"
    assert (prof["model"]["seq_len"], prof["model"]["mb_size"]) == (32, 1)
    out = tmp_path / "run.json"
    code, stdout, err = invoke("run", "--torchtitan-config", LLAMA, *PP2, *S32, "--training.local_batch_size", "4",
                               "--profile", str(profile), "-o", str(out), *FAST_RUN)
    assert code == 0, err
    assert "stages and schedule built by torchtitan's pipeline helpers" in stdout
    data = json.loads(out.read_text())
    assert (data["schedule"], data["ranks"], data["microbatches"], data["stages"]) == ("Interleaved1F1B", 2, 4, 4)
    assert data["grad_ok"] and data["loss_match"] and data["num_params_checked"] > 0
    assert multiprocessing.active_children() == []
