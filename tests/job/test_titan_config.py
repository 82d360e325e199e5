"""torchtitan 0.3.0 job configs (``--torchtitan-config MODULE:CONFIG``) and ``--parallelism.KEY VALUE`` overrides.

The override parser is core (plain Python) and is tested without torchtitan; reading a config function needs the
torchtitan extra (those tests are marked ``torch`` and skip without it).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from profile_v2 import make_v2_profile
from typer.testing import CliRunner

from ppsim.cli import app
from ppsim.errors import TorchtitanConfigError
from ppsim.job.overrides import parse_overrides
from ppsim.job.pipeline import job_from_settings, load_torchtitan_job
from ppsim.job.settings import FIELD_TYPES, JobSettings, is_registry_name
from ppsim.profile import save_profile
from ppsim.split import SplitSpec

runner = CliRunner()
LLAMA = "llama3:llama3_debugmodel"
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"]
"""Two pipeline ranks; torchtitan 0.3.0 refuses a pipeline unless CUDA graphs are off (its own command line needs
the same flag)."""


def has_torchtitan() -> bool:
    try:
        import torchtitan.distributed.pipeline_parallel  # noqa: F401
    except ImportError:
        return False
    return True


def invoke(args: list[str]) -> tuple[int, str, str]:
    result = runner.invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


# --- the override parser (torchtitan's command-line rules) -----------------------------------------------------
FIELDS = {**FIELD_TYPES, "parallelism.enable_compiled_autograd": bool, "training.max_norm": float | int}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--parallelism.pipeline_parallel_degree", "4"], {"parallelism.pipeline_parallel_degree": 4}),
        (["--parallelism.pipeline-parallel-degree=4"], {"parallelism.pipeline_parallel_degree": 4}),
        (["--parallelism.pipeline_parallel_layers_per_stage", "None"],
         {"parallelism.pipeline_parallel_layers_per_stage": None}),
        (["--parallelism.enable_compiled_autograd"], {"parallelism.enable_compiled_autograd": True}),
        (["--parallelism.no-enable-compiled-autograd"], {"parallelism.enable_compiled_autograd": False}),
        (["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0", "layers.1,norm",
          "--training.seq_len", "64"],
         {"parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["layers.1", "norm"]],
          "training.seq_len": 64}),
        (["--training.max_norm", "0.5"], {"training.max_norm": 0.5}),
        (["--parallelism.pipeline_parallel_schedule_csv", "a.csv"],
         {"parallelism.pipeline_parallel_schedule_csv": "a.csv"}),
    ],
)
def test_overrides_follow_torchtitans_command_line_rules(args: list[str], expected: dict) -> None:
    assert parse_overrides(args, FIELDS) == expected


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--parallelism.pipeline_parallel_degre", "2"], "did you mean --parallelism.pipeline_parallel_degree?"),
        (["--parallelism.pipeline_parallel_degree", "two"], "not an integer"),
        (["--parallelism.pipeline_parallel_degree", "2.5"], "not an integer"),
        (["--parallelism.pipeline_parallel_degree"], "needs a value"),
        (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "3"],
         "given twice"),
        (["--parallelism.enable_compiled_autograd=False"], "is a flag and takes no value"),
        (["--compile.enable"], "ppsim reads only --parallelism.KEY and --training.KEY"),
        (["--training.max_norm", "nan"], "not a number or an integer"),
        (["--parallelism.pipeline_parallel_degree", "2", "oops"], "unexpected argument 'oops'"),
        (["--training.seq_len", "9" * 30], "not an integer"),
    ],
)
def test_bad_overrides_are_one_line(args: list[str], says: str) -> None:
    with pytest.raises(TorchtitanConfigError) as info:
        parse_overrides(args, FIELDS)
    assert says in str(info.value) and "\n" not in str(info.value)


@given(value=st.integers(-(10**12), 10**12),
       key=st.sampled_from(["pipeline_parallel_degree", "pipeline-parallel-degree"]), joined=st.booleans())
def test_an_integer_override_reads_the_same_in_every_spelling(value: int, key: str, joined: bool) -> None:
    args = [f"--parallelism.{key}={value}"] if joined else [f"--parallelism.{key}", str(value)]
    assert parse_overrides(args, FIELDS) == {"parallelism.pipeline_parallel_degree": value}


def test_registry_names_and_toml_paths_are_told_apart(tmp_path: Path) -> None:
    assert is_registry_name("llama3:llama3_debugmodel") and is_registry_name("torchtitan.models.llama3:x")
    assert not is_registry_name("job.toml") and not is_registry_name(str(tmp_path / "x.toml"))


def test_toml_jobs_take_overrides_too(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[parallelism]\npipeline_parallel_degree = 2\nmy_setting = "x"\n[training]\nlocal_batch_size = 8\n')
    job = load_torchtitan_job(path, overrides=["--parallelism.pipeline_parallel_degree", "4",
                                               "--training.local_batch_size=16"])
    assert (job.num_ranks, job.num_microbatches) == (4, 16)
    with pytest.raises(TorchtitanConfigError, match="did you mean --parallelism.pipeline_parallel_degree"):
        load_torchtitan_job(path, overrides=["--parallelism.pipeline_parallel_degee", "4"])
    code, out, err = invoke(["simulate", "--torchtitan-config", str(path), "--parallelism.pipeline_parallel_degree",
                             "4", "--json"])
    assert code == 0, err
    assert json.loads(out)["ranks"] == 4


def test_a_schedule_torchtitan_runs_but_ppsim_cannot_is_refused_by_name() -> None:
    settings = JobSettings(source="m:c", parallelism={"pipeline_parallel_degree": 2,
                                                      "pipeline_parallel_schedule": "ScheduleFromTheFuture"},
                           training={}, in_file=False, known_schedules=("1F1B", "ScheduleFromTheFuture"))
    with pytest.raises(TorchtitanConfigError, match="one torchtitan runs but ppsim cannot simulate"):
        job_from_settings(settings)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--parallelism.pipeline_parallel_degree", "2"], "pass --torchtitan-config"),
        (["--rank", "2"], "did you mean --ranks?"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_extra_arguments_without_a_job_config_are_one_line(args: list[str], says: str) -> None:
    code, _, err = invoke(["simulate", "-s", "1F1B", "-r", "2", "-m", "4", *args])
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_torchtitan_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import torchtitan -> ImportError
    code, _, err = invoke(["simulate", "--torchtitan-config", LLAMA, *PP2])
    assert code == 2 and 'pip install "ppsim[torchtitan]"' in err and err.count("\n") == 1, err


# --- config functions (torchtitan installed) -------------------------------------------------------------------
@pytest.fixture()
def registry_job():
    """:func:`ppsim.calibrate.torchtitan.config.load_registry_job`; the test skips without torchtitan."""
    if not has_torchtitan():
        pytest.skip("needs the torchtitan extra")
    from ppsim.calibrate.torchtitan.config import load_registry_job

    return load_registry_job


@pytest.mark.torch
def test_a_config_function_becomes_torchtitans_pipeline(registry_job) -> None:
    job = registry_job(LLAMA, overrides=PP2)
    # llama3_debugmodel: Interleaved1F1B, local batch 8 / microbatch 1, 6 layers; 2 stages per rank by default
    assert (job.schedule, job.num_ranks, job.num_microbatches, job.stages_per_rank) == ("Interleaved1F1B", 2, 8, 2)
    assert job.model_source == "torchtitan:llama3/debugmodel" and job.seq_len == 2048
    assert job.stage_modules == (("tok_embeddings", "layers.0"), ("layers.1", "layers.2"), ("layers.3", "layers.4"),
                                 ("layers.5", "norm", "lm_head"))
    assert job.rank_stages == ((0, 2), (1, 3))
    assert job.split.split in (None, (1, 2, 2, 1)) and job.warnings == ()


@pytest.mark.torch
def test_an_override_torchtitans_own_checks_refuse_is_named(registry_job) -> None:
    job = registry_job(LLAMA, overrides=["--parallelism.pipeline_parallel_degree", "2"])
    assert job.num_ranks == 2
    assert [w for w in job.warnings if "torchtitan would refuse" in w and "--training.disable_cuda_graphs" in w]


@pytest.mark.torch
def test_a_full_module_path_is_read_as_torchtitans_command_line_reads_it(registry_job) -> None:
    job = registry_job("torchtitan.models.llama3:llama3_debugmodel", overrides=PP2)
    assert job.model_source == "torchtitan:llama3/debugmodel"


@pytest.mark.torch
def test_layers_per_stage_uses_the_models_own_layer_count(registry_job) -> None:
    job = registry_job(LLAMA, overrides=[*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "1"])
    assert job.stages_per_rank == 4 and len(job.stage_modules) == 8  # (6 + 2) / 1 stages on 2 ranks
    job = registry_job(LLAMA, overrides=[*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                                         "--parallelism.pipeline_parallel_layers_per_stage", "2"])
    assert job.rank_stages == ((0, 3), (1, 2))


@pytest.mark.torch
def test_module_lists_and_layers_per_stage_name_the_dropped_key(registry_job) -> None:
    parts = ["tok_embeddings,layers.0,layers.1", "layers.2", "layers.3,layers.4", "layers.5,norm,lm_head"]
    job = registry_job(LLAMA, overrides=[*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "2",
                                         "--parallelism.module_fqns_per_model_part", *parts])
    assert job.split == SplitSpec(split=(2, 1, 2, 1)) and job.stage_modules[1] == ("layers.2",)
    assert any("pipeline_parallel_layers_per_stage = 2 does not decide the split" in w for w in job.warnings)


@pytest.mark.torch
def test_cli_simulates_a_config_function_with_overrides(registry_job) -> None:
    code, out, err = invoke(["simulate", "--torchtitan-config", LLAMA, *PP2, "--training.local_batch_size", "4",
                             "--json"])
    assert code == 0, err
    data = json.loads(out)
    _, direct, _ = invoke(["simulate", "-s", "Interleaved1F1B", "-r", "2", "-m", "4", "--json"])
    assert (data["ranks"], data["microbatches"], data["stages_per_rank"]) == (2, 4, 2)
    assert data["makespan"] == json.loads(direct)["makespan"]


@pytest.mark.torch
def test_plot_and_report_take_a_config_function(registry_job, tmp_path: Path) -> None:
    html = tmp_path / "r.html"
    code, _, err = invoke(["report", "--torchtitan-config", LLAMA, *PP2, "-o", str(html)])
    assert code == 0 and html.is_file(), err
    svg = tmp_path / "p.svg"
    code, _, err = invoke(["plot", "--torchtitan-config", LLAMA, "--parallelism.pipeline_parallel_degree=2",
                           "-o", str(svg)])
    assert code == 0 and svg.is_file(), err


@pytest.mark.torch
def test_a_profile_of_another_model_is_refused(registry_job, tmp_path: Path) -> None:
    profile = save_profile(make_v2_profile(num_layers=8), tmp_path / "p.json")
    code, _, err = invoke(["simulate", "--torchtitan-config", LLAMA, *PP2, "--profile", str(profile)])
    assert code == 2 and "models 8 layers but llama3/debugmodel" in err
    assert "--model torchtitan:llama3/debugmodel" in err
    profile = save_profile(make_v2_profile(num_layers=6), tmp_path / "p6.json")
    code, out, err = invoke(["simulate", "--torchtitan-config", LLAMA, *PP2, "--profile", str(profile), "--json"])
    assert code == 0, err
    assert "seq_len 4" in err  # the profile's microbatch shape differs from the job's: named, not hidden


def user_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's own config registry, importable as ``myjobs`` (fresh for each test)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "myjobs"]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    package = tmp_path / "myjobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n\n"
        "def two_ranks():\n    c = llama3_debugmodel()\n    c.parallelism.pipeline_parallel_degree = 2\n"
        "    c.parallelism.pipeline_parallel_schedule = '1F1B'\n    return c\n\n"
        "def needs_a_gpu():\n    raise RuntimeError('no CUDA device\\nsecond line')\n\n"
        "def exits():\n    import sys\n    sys.exit(0)\n\n"
        "def not_a_job():\n    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "myjobs"


@pytest.mark.torch
def test_a_users_own_config_module_is_read(registry_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = registry_job(f"{user_configs(tmp_path, monkeypatch)}:two_ranks")
    assert (job.schedule, job.num_ranks, job.stages_per_rank) == ("1F1B", 2, 1)


@pytest.mark.torch
@pytest.mark.parametrize(
    ("config", "extra", "says"),
    [
        ("llama3:llama3_debugmodle", [], "did you mean llama3:llama3_debugmodel"),
        ("llama4:llama3_debugmodel", [], "did you mean llama3?"),
        ("no_such_pkg:job", [], "no config registry module 'no_such_pkg'"),
        ("llama3:", [], "give MODULE:CONFIG"),
        ("USER:needs_a_gpu", [], "needs_a_gpu() raised RuntimeError: no CUDA device"),
        ("USER:not_a_job", [], "not a Trainer.Config"),
        ("USER:exits", [], "exits() called sys.exit(0)"),
        ("llama3:model_registry", [], "model_registry is not a config function"),  # needs a flavor: never called
        ("USER:zzz", [], "its config functions are exits, needs_a_gpu, not_a_job, two_ranks"),
        (LLAMA, ["--parallelism.pipeline_parallel_degre", "2"], "did you mean --parallelism.pipeline_parallel_degree"),
        (LLAMA, ["--parallelism.pipeline_parallel_degree", "two"], "not an integer"),
        (LLAMA, ["--training.local_batch_size", "1.5"], "not an integer"),
        (LLAMA, ["--parallelism.spmd_backend", "mpi"], "must be one of"),
        (LLAMA, [*PP2, "--training.local_batch_size", "3", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         "not divisible by"),
        (LLAMA, [*PP2, "--parallelism.pipeline_parallel_schedule_csv", "TMP/order.txt"], "files named *.csv"),
        (LLAMA, [*PP2, "--parallelism.pipeline_parallel_schedule", "PipelineScheduleMulti"],
         "needs pipeline_parallel_schedule_csv"),
        (LLAMA, [*PP2, "--parallelism.pipeline_parallel_schedule", "ZBH1"], "is not one torchtitan runs"),
        (LLAMA, [*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "4"], "at least 2 per rank"),
        (LLAMA, [*PP2, "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.1", "layers.0,norm"],
         "module_fqns_per_model_part part 0 lists layers.1"),
        (LLAMA, ["--training.global_batch_size", "7"], "with data_parallel_shard_degree -1"),
        (LLAMA, ["--parallelism.pipeline_parallel_degree", "8", "--training.disable_cuda_graphs"],
         "cannot be greater than effective layers"),
        (LLAMA, [*PP2, "-r", "4"], "pass --parallelism.pipeline_parallel_degree VALUE"),
    ],
)
def test_bad_config_functions_and_overrides_are_one_line(
    registry_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str, extra: list[str], says: str
) -> None:
    config = config.replace("USER", user_configs(tmp_path, monkeypatch))
    (tmp_path / "order.txt").write_text("F0\n")
    extra = [a.replace("TMP", str(tmp_path)) for a in extra]
    code, out, err = invoke(["simulate", "--torchtitan-config", config, *extra])
    assert code == 2 and says in err and err.count("\n") == 1 and out == "", err
