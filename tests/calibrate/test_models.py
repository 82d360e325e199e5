"""Model sources (`--model`): builtin, torchtitan, python factories; per-kind blocks; estimates; one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from one_line import one_line_error
from typer.testing import CliRunner

from ppsim.calibrate.models import SDPA_ON_CPU, ModelOptions, kinds_of, parse_model_source
from ppsim.cli import app
from ppsim.costs import CostSpec
from ppsim.errors import PPSimError
from ppsim.profile import load_profile
from ppsim.schedules import get_schedule

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
# Small microbatches: every test here shares two cores with other work.
TINY_MB = ModelOptions(seq_len=16, mb_size=1)
FAST_CAL = ["--seq-len", "16", "--mb-size", "1", "--reps", "3", "--warmup", "1", "--no-p2p", "--no-probe"]


def has_torchtitan() -> bool:
    try:
        import torchtitan.models  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchtitan = pytest.mark.skipif(not has_torchtitan(), reason="torchtitan not installed (ppsim[torchtitan])")


# --- parsing and kinds (no model built) ---------------------------------------------------------------------------
def test_builtin_is_the_default_and_preset_an_alias() -> None:
    default = parse_model_source(None)
    assert default.text == "builtin:tiny" and default.config.preset == "tiny"
    assert parse_model_source(None, preset="1b").config == parse_model_source("builtin:1b").config
    assert parse_model_source("tiny").text == "builtin:tiny"  # a bare preset name
    custom = parse_model_source("builtin:tiny", ModelOptions(layers=3, seq_len=16))
    assert custom.config.layers == 3 and custom.config.preset == "custom" and custom.layout() == [
        "embed", "layer", "layer", "layer", "head"]


def test_kinds_name_distinct_structures_in_first_seen_order() -> None:
    kinds, desc = kinds_of(["a", "b", "b", "c"], ["dense", "moe", "moe", "moe"], ["d", "m", "m", "m2"])
    assert kinds == ("dense", "moe", "moe", "moe-2")
    assert desc == (("dense", "d"), ("moe", "m"), ("moe-2", "m2"))
    assert kinds_of(["x", "x"], ["dense", "dense"], ["d", "d"])[0] == ("layer", "layer")


@needs_torchtitan
def test_deepseek_v3_has_a_dense_and_a_moe_kind_and_sdpa_on_cpu() -> None:
    source = parse_model_source("torchtitan:deepseek_v3/debugmodel", TINY_MB)
    assert source.layer_kinds == ("dense", "moe", "moe", "moe", "moe", "moe")
    assert source.layout() == ["embed", "layer.dense", *["layer.moe"] * 5, "head"]
    assert source.attention == SDPA_ON_CPU == "sdpa (FlexAttention has no CPU backward)"
    assert source.num_params == 33_014_016 and source.config.hidden == 256 and source.config.vocab == 2048
    kinds = source.describe()["kinds"]
    assert "MoE (8 experts, top 3" in kinds["moe"] and "feed-forward" in kinds["dense"]


@needs_torchtitan
def test_llama3_layers_are_one_kind_and_the_layer_override_keeps_kinds() -> None:
    llama = parse_model_source("torchtitan:llama3/debugmodel", TINY_MB)
    assert llama.kinds == ("layer",) and llama.num_layers == 6 and llama.layout()[1] == "layer"
    longer = parse_model_source("torchtitan:llama3/debugmodel", ModelOptions(layers=9, seq_len=16, mb_size=1))
    assert longer.num_layers == 9 and longer.num_params > llama.num_params
    short = parse_model_source("torchtitan:deepseek_v3/debugmodel", ModelOptions(layers=3, seq_len=16, mb_size=1))
    assert short.layer_kinds == ("dense", "moe", "moe")
    one = parse_model_source("torchtitan:deepseek_v3/debugmodel", ModelOptions(layers=1, seq_len=16, mb_size=1))
    assert one.kinds == ("layer",)  # only the dense layer is left


# --- weights: a stage holds exactly the full model's blocks ---------------------------------------------------------
@pytest.mark.parametrize("text", [
    "builtin:tiny",
    pytest.param("torchtitan:llama3/debugmodel", marks=needs_torchtitan),
    pytest.param("torchtitan:deepseek_v3/debugmodel", marks=needs_torchtitan),
])
def test_stages_hold_the_full_models_weights_and_chain_to_its_output(text: str) -> None:
    source = parse_model_source(text, ModelOptions(seq_len=8, mb_size=1, layers=4))
    full = source.build_full(seed=3)
    params = dict(full.named_parameters())
    first = source.build_stage([0, 1], has_embedding=True, has_head=False, seed=3)
    last = source.build_stage([2, 3], has_embedding=False, has_head=True, seed=3)
    for ids, stage in (((0, 1), first), ((2, 3), last)):
        for name, p in stage.named_parameters():
            assert torch.equal(p, params[source.reference_name(ids, name)]), name
    assert sum(p.numel() for p in first.parameters()) + sum(p.numel() for p in last.parameters()) == sum(
        p.numel() for p in full.parameters())
    tokens, _ = source.make_batch(1, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=1e-5, atol=1e-5)


def test_python_factory_stages_chain_and_name_their_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(DATA)
    source = parse_model_source("python:toy_factory:make_toy", ModelOptions(seq_len=8, mb_size=2))
    assert source.layer_kinds == ("block", "block", "block-2", "block")
    assert source.config.hidden == 16 and source.config.vocab == 64
    full = source.build_full(seed=0)
    a = source.build_stage([0, 1], has_embedding=True, has_head=False)
    b = source.build_stage([2, 3], has_embedding=False, has_head=True)
    tokens, targets = source.make_batch(1)
    with torch.no_grad():
        torch.testing.assert_close(b(a(tokens)), full(tokens))
    assert source.loss_fn(full(tokens), targets).ndim == 0
    named = parse_model_source("python:toy_factory:make_named", ModelOptions(seq_len=8, mb_size=2))
    assert named.num_layers == 2 and named.kinds == ("layer",)
    sys.modules.pop("toy_factory", None)


# --- bad input: one line, exit 2, nothing left behind ----------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "builtin:huge"], "unknown builtin model; use one of builtin:tiny"),
    (["--model", "nonsense:x"], "expected builtin:NAME, torchtitan:FAMILY/FLAVOR or python:PKG.MODULE:FACTORY"),
    (["--model", "torchtitan:llama3"], "expected torchtitan:FAMILY/FLAVOR"),
    (["--model", "python:toy_factory"], "expected python:PKG.MODULE:FACTORY"),
    (["--model", "python:broken_factory:make"], "does not import (ModuleNotFoundError"),
    (["--model", "python:toy_factory:nothing_here"], "has no 'nothing_here'"),
    (["--model", "python:toy_factory:NOT_CALLABLE"], "is a int, not callable"),
    (["--model", "python:toy_factory:make_number"], "returned int, not an nn.Module"),
    (["--model", "python:toy_factory:make_flat"], "has no embedding module at 'tok_embeddings'"),
    (["--model", "python:toy_factory:make_toy", "--layers", "2"], "cannot change a factory's layer count"),
    (["--model", "builtin:tiny", "--preset", "1b"], "--preset is an alias"),
    (["--preset", "70b"], "unknown preset"),
    (["--model", "builtin:tiny", "--layers", "0"], "--layers 0"),
])
def test_bad_model_sources_give_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                                         expected: str) -> None:
    monkeypatch.chdir(DATA)
    out = tmp_path / "p.json"
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(out), *args, *FAST_CAL]))
    assert expected in line
    assert not out.exists()
    sys.modules.pop("toy_factory", None)


@needs_torchtitan
@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "torchtitan:nosuch/debugmodel"], "unknown torchtitan family 'nosuch'; use one of"),
    (["--model", "torchtitan:llama3/huge"], "unknown flavor 'huge' of torchtitan's llama3; use one of debugmodel"),
    (["--model", "torchtitan:llama3/debugmodel", "--hidden", "64"], "shape options apply to builtin models only"),
    (["--model", "torchtitan:deepseek_v3/debugmodel", "--seq-len", "20000"], "handles at most 16384 tokens"),
    (["--model", "torchtitan:llama3/8B"], "--allow-large"),
])
def test_bad_torchtitan_sources_give_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                                             expected: str) -> None:
    from ppsim.calibrate.measure import speed

    # the estimate divides by the matmul speed measured on this host: a fixed one keeps the refusal independent of
    # the machine (20 GFLOP/s, a 2-core VM's float32 speed)
    monkeypatch.setattr(speed, "matmul_flops_per_s", lambda *args: 20e9)
    out = tmp_path / "p.json"
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(out), "--reps", "1", *args]))
    assert expected in line
    assert not out.exists()


@pytest.mark.parametrize("model", ["builtin:tiny", pytest.param("torchtitan:llama3/debugmodel",
                                                                   marks=needs_torchtitan)])
def test_a_layer_override_that_does_not_fit_the_run_is_refused_before_calibrating(tmp_path: Path,
                                                                                  model: str) -> None:
    line = one_line_error(runner.invoke(app, ["run", "--model", model, "--layers", "1", "-s", "1F1B", "-r", "4",
                                              "-m", "4", "-o", str(tmp_path / "run.json")]))
    assert "4 stages" in line and "1 layers" in line
    assert list(tmp_path.iterdir()) == []


@needs_torchtitan
def test_the_unknown_family_line_lists_the_valid_ones(tmp_path: Path) -> None:
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), "--model",
                                              "torchtitan:llama/debugmodel"]))
    assert "llama3" in line and "deepseek_v3" in line and "qwen3" in line


def test_without_torchtitan_the_line_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # `import torchtitan...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchtitan.models", None)
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), "--model",
                                              "torchtitan:llama3/debugmodel"]))
    assert 'torchtitan is not installed' in line and 'pip install "ppsim[torchtitan]"' in line


@needs_torchtitan
def test_a_flavor_that_needs_cuda_is_refused_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchtitan.models.llama3 as llama3

    def registry(flavor: str, **_: Any) -> Any:
        raise ValueError("Flash backend of FlexAttention is only supported on Hopper or Blackwell")

    monkeypatch.setattr(llama3, "model_registry", registry)
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), "--model",
                                              "torchtitan:llama3/debugmodel"]))
    assert "needs CUDA" in line and "Hopper" in line


@needs_torchtitan
def test_70b_is_refused_from_the_estimate_without_building_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.measure import calibration
    from ppsim.calibrate.measure.calibration import CalibrationOptions, check_limits

    monkeypatch.setattr(calibration, "device_memory_bytes", lambda device: 16 * 2**30)
    source = parse_model_source("torchtitan:llama3/70B")
    assert source.num_params > 70e9 and source.estimate.param_bytes > 280e9
    with pytest.raises(PPSimError, match="--allow-large") as info:  # at size: one float32 layer at 2048 tokens
        check_limits(CalibrationOptions(output=Path("unused.json"), config=source.config, source=source))
    assert "one layer of torchtitan:llama3/70B" in str(info.value)
    check_limits(CalibrationOptions(output=Path("unused.json"), config=source.config, source=source,
                                    override_limits=True))


# --- calibrating per kind ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not has_torchtitan():
        pytest.skip("torchtitan not installed (ppsim[torchtitan])")
    path = tmp_path_factory.mktemp("deepseek") / "ds.json"
    result = runner.invoke(app, ["calibrate", "-o", str(path), "--model", "torchtitan:deepseek_v3/debugmodel",
                                 *FAST_CAL])
    assert result.exit_code == 0, result.output
    assert SDPA_ON_CPU in result.output
    return path


def test_deepseek_dense_and_moe_layers_are_measured_apart(deepseek_profile: Path) -> None:
    doc = json.loads(deepseek_profile.read_text())
    profile = load_profile(deepseek_profile)
    assert doc["version"] == 3 and profile.version == 3
    assert set(doc["units"]) == {"embed", "layers1", "layers4", "kind.dense", "head"}
    assert doc["units"]["layers4"]["layers"] == [1, 5] and doc["units"]["kind.dense"]["layers"] == [0, 1]
    assert profile.layout == ("embed", "layer.dense", *["layer.moe"] * 5, "head")
    src = profile.source
    assert src is not None and src.source == "torchtitan:deepseek_v3/debugmodel" and src.flavor == "debugmodel"
    assert src.num_params == 33_014_016 and src.attention == SDPA_ON_CPU
    assert src.layer_kinds == ("dense", "moe", "moe", "moe", "moe", "moe")
    dense, moe = profile.blocks["layer.dense"], profile.blocks["layer.moe"]
    assert dense.param_bytes != moe.param_bytes and dense.activation_bytes != moe.activation_bytes
    assert dense.F.median != moe.F.median and dense.B.median != moe.B.median
    assert f"attention: {SDPA_ON_CPU}" in profile.notes


def test_a_stage_costs_the_layers_it_holds(deepseek_profile: Path) -> None:
    profile = load_profile(deepseek_profile)
    blocks, over = profile.blocks, profile.stage_overhead
    for ranks in (2, 4, 8):
        schedule = get_schedule("1F1B", ranks, 2 * ranks)
        costs = CostSpec.from_profile(profile).for_schedule(schedule)
        first = 0
        for s, n in enumerate(costs.split_counts):
            names = list(profile.layout[1 + first:1 + first + n])
            names = (["embed"] if s == 0 else []) + names + (["head"] if s == ranks - 1 else [])
            expected = sum(blocks[b].F.median for b in names) + over.F.median
            assert costs.F[s] == pytest.approx(expected, rel=1e-12)
            assert costs.activation_bytes[s] == sum(blocks[b].activation_bytes for b in names)
            first += n


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_one_torchtitan_profile_drives_simulate_report_and_search(deepseek_profile: Path, tmp_path: Path,
                                                                 ranks: int) -> None:
    sim = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", str(ranks), "-m", str(2 * ranks), "--profile",
                              str(deepseek_profile), "--json"])
    assert sim.exit_code == 0, sim.output
    assert json.loads(sim.stdout)["makespan"] > 0
    png = tmp_path / "p.png"
    plot = runner.invoke(app, ["plot", "-s", "ZBH1", "-r", str(ranks), "-m", str(2 * ranks), "--profile",
                               str(deepseek_profile), "-o", str(png)])
    assert plot.exit_code == 0, plot.output
    assert png.exists()
    html = tmp_path / "r.html"
    report = runner.invoke(app, ["report", "-s", "1F1B,ZBH1", "-r", str(ranks), "-m", str(2 * ranks), "--profile",
                                 str(deepseek_profile), "-o", str(html)])
    assert report.exit_code == 0, report.output
    assert html.exists()
    found = runner.invoke(app, ["search", "-r", str(ranks), "-m", str(2 * ranks), "--profile", str(deepseek_profile),
                                "--memory-cap", "1GiB", "--max-orders", "20", "--solver", "none", "--json", "-q"])
    assert found.exit_code == 0, found.output


@pytest.mark.slow
def test_deepseek_runs_1f1b_and_passes_the_numerics_check(deepseek_profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", str(deepseek_profile),
                                 "--steps", "1", "--warmup", "1", "--probes", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["grad_ok"] and data["loss_match"] and data["num_params_checked"] > 0


@pytest.mark.slow
@needs_torchtitan
def test_llama3_runs_from_model_without_profile(tmp_path: Path) -> None:
    """`ppsim run --model torchtitan:llama3/debugmodel` (small microbatch, short calibration first)."""
    out = tmp_path / "run.json"
    opts = ["--model", "torchtitan:llama3/debugmodel", "--seq-len", "16", "--mb-size", "1"]
    prof = tmp_path / "llama.json"
    cal = runner.invoke(app, ["calibrate", "-o", str(prof), *opts, "--reps", "2", "--warmup", "1", "--no-p2p",
                              "--no-probe"])
    assert cal.exit_code == 0, cal.output
    result = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", str(prof), *opts,
                                 "--steps", "1", "--warmup", "1", "--probes", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["grad_ok"]
    other = runner.invoke(app, ["run", "-s", "1F1B", "-r", "2", "-m", "4", "--profile", str(prof), "--model",
                                "torchtitan:deepseek_v3/debugmodel"])
    assert "measured on torchtitan:llama3/debugmodel" in one_line_error(other)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention is kept on CUDA)")
@needs_torchtitan
def test_cuda_keeps_the_flavors_flex_attention(tmp_path: Path) -> None:
    source = parse_model_source("torchtitan:llama3/debugmodel", TINY_MB, device="cuda")
    assert source.attention == "flex"
    path = tmp_path / "llama.json"
    result = runner.invoke(app, ["calibrate", "--device", "cuda", "-o", str(path), "--model",
                                 "torchtitan:llama3/debugmodel", *FAST_CAL])
    assert result.exit_code == 0, result.output
    assert load_profile(path).source.attention == "flex"
