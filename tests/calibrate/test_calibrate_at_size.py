"""Calibration at size: one block at a time from a meta-device build; the estimate counts one block alive at once;
a block too large is refused with what would fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppsim.calibrate.models import ModelOptions, parse_model_source
from ppsim.cli import app
from ppsim.costs import CostSpec
from ppsim.errors import PPSimError
from ppsim.profile import load_profile
from ppsim.schedules import get_schedule

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan.models")
pytestmark = pytest.mark.torch

runner = CliRunner()
GIB = 2**30
TINY = ModelOptions(seq_len=16, mb_size=1)


def _options(tmp: Path, text: str, **kw: object) -> object:
    from ppsim.calibrate.measure.calibration import CalibrationOptions

    source = parse_model_source(text, TINY)
    return CalibrationOptions(output=tmp / "p.json", config=source.config, source=source, warmup=1, reps=3,
                              p2p=False, probe=False, **kw)


@pytest.fixture(scope="module")
def at_size_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ppsim.calibrate.measure.calibration import calibrate

    opts = _options(tmp_path_factory.mktemp("at_size"), "torchtitan:deepseek_v3/debugmodel", at_size=True)
    calibrate(opts, log=lambda _: None)
    return opts.output  # type: ignore[attr-defined]


def test_a_stage_at_size_allocates_only_its_blocks() -> None:
    from ppsim.calibrate.models import torchtitan as tt

    source = parse_model_source("torchtitan:llama3/debugmodel", TINY)
    tt._CACHE.clear()
    stage = source.build_stage((1,), has_embedding=False, has_head=False, random_weights=True)
    assert not tt._CACHE  # the whole model was never materialised
    reference = source.build_stage((1,), has_embedding=False, has_head=False)
    shapes = {n: p.shape for n, p in stage.named_parameters()}
    assert shapes == {n: p.shape for n, p in reference.named_parameters()}
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in stage.parameters())
    x = source.stage_input(first=False)
    assert stage(x).shape == x.shape


def test_each_kind_is_measured_alone_and_the_overhead_is_folded_into_the_blocks(at_size_profile: Path) -> None:
    doc = json.loads(at_size_profile.read_text())
    assert set(doc["units"]) == {"embed", "layers1", "kind.dense", "head"}
    profile = load_profile(at_size_profile)
    assert profile.layout == ("embed", "layer.dense", *["layer.moe"] * 5, "head")
    assert all(getattr(profile.stage_overhead, op).median == 0 for op in ("F", "B", "FB"))
    assert any(n.startswith("calibrated at size") for n in profile.notes)
    meta = parse_model_source("torchtitan:deepseek_v3/debugmodel", TINY)
    moe = meta.build_stage((1,), has_embedding=False, has_head=False, device="meta")
    assert profile.blocks["layer.moe"].param_bytes == sum(p.numel() * 4 for p in moe.parameters())


@pytest.mark.parametrize("ranks", [2, 3, 6])
def test_the_per_block_profile_composes_any_pp_degree(at_size_profile: Path, ranks: int) -> None:
    profile = load_profile(at_size_profile)
    schedule = get_schedule("1F1B", ranks, 2 * ranks)
    costs = CostSpec.from_profile(profile).for_schedule(schedule)
    assert sum(costs.split_counts) == 6
    first = 0
    for s, n in enumerate(costs.split_counts):
        names = (["embed"] if s == 0 else []) + list(profile.layout[1 + first:1 + first + n]) + (
            ["head"] if s == ranks - 1 else [])
        assert costs.F[s] == pytest.approx(sum(profile.blocks[b].F.median for b in names), rel=1e-12)
        first += n


def test_70b_at_a_short_sequence_goes_at_size_and_counts_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.measure import calibration as cal

    monkeypatch.setattr(cal, "device_memory_bytes", lambda device: 24 * GIB)
    source = parse_model_source("torchtitan:llama3/70B", ModelOptions(dtype="bfloat16", seq_len=128))
    opts = cal.CalibrationOptions(output=Path("unused.json"), config=source.config, source=source, reps=3,
                                  warmup=1, probe=False)
    assert cal.decide_at_size(opts).at_size
    line = cal.estimate_line(opts)
    assert line.startswith("estimate: at size") and "never materialised" in line
    est = cal.at_size_estimate(source, device="cpu", reps=3, warmup=1, probe=False)
    # the head (1.05B parameters): weights, gradients, its weight's transient gradient in bf16 and in float32,
    # three microbatches of logits
    head = 2 * (8192 * 128256 + 8192)
    assert est.block == "head" and est.weight_bytes == head
    assert est.need_bytes == 5 * head + 3 * est.activation_bytes
    cal.check_limits(opts)  # fits: nothing raised


@pytest.mark.parametrize(("text", "opts_", "fits", "device"), [
    ("torchtitan:llama3/70B", ModelOptions(), r"one layer of .* --seq-len \d+ would fit", "cpu"),
    ("torchtitan:deepseek_v3/671B", ModelOptions(seq_len=128, dtype="bfloat16"),
     r"one layer of .* a tensor-parallel degree of \d+ would fit .*: --tp \d+", "cuda"),
    ("torchtitan:deepseek_v3/671B", ModelOptions(seq_len=128, dtype="bfloat16"),  # local --tp ranks share the host
     r"one layer of .* --tp does not lower that here", "cpu"),
    ("torchtitan:llama3/405B", ModelOptions(seq_len=128, dtype="bfloat16"),
     "one head of .* the head is measured whole", "cpu"),
])
def test_a_block_too_large_is_refused_naming_what_would_fit(monkeypatch: pytest.MonkeyPatch, text: str,
                                                            opts_: ModelOptions, fits: str, device: str) -> None:
    from ppsim.calibrate.measure import calibration as cal

    monkeypatch.setattr(cal, "device_memory_bytes", lambda device: 16 * GIB)
    source = parse_model_source(text, opts_)
    opts = cal.CalibrationOptions(output=Path("unused.json"), config=source.config, source=source, device=device)
    with pytest.raises(PPSimError, match="--allow-large") as info:
        cal.check_limits(opts)
    assert re.search(fits, str(info.value)), str(info.value)


def test_calibrate_prints_its_estimate_first(tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), "--seq-len", "16", "--mb-size", "1",
                                 "--reps", "2", "--warmup", "0", "--no-p2p", "--no-probe"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("estimate: about ")


@pytest.mark.parametrize(("args", "expected"), [
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--tp", "2"], "tensor-parallel measurement uses torchtitan's own sharding plan"),
    (["--tp", "3", "--model", "torchtitan:llama3/debugmodel"], "--tp 3: does not divide the 16 attention heads"),
])
def test_bad_tensor_parallel_degrees_are_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), *args])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and expected in errors[0], result.output


@pytest.mark.slow
def test_layers_are_measured_as_torchtitan_shards_them_at_tp_2(tmp_path: Path) -> None:
    path = tmp_path / "tp2.json"
    result = runner.invoke(app, ["calibrate", "-o", str(path), "--model", "torchtitan:llama3/debugmodel", "--tp", "2",
                                 "--seq-len", "16", "--mb-size", "1", "--reps", "2", "--warmup", "0", "--no-p2p",
                                 "--no-probe"])
    assert result.exit_code == 0, result.output
    profile = load_profile(path)
    assert profile.tensor_parallel_degree == 2
    meta = parse_model_source("torchtitan:llama3/debugmodel", TINY).build_stage(
        (0,), has_embedding=False, has_head=False, device="meta")
    whole = sum(p.numel() * 4 for p in meta.parameters())
    norms = sum(p.numel() * 4 for n, p in meta.named_parameters() if "norm" in n)
    assert profile.blocks["layer"].param_bytes == (whole - norms) // 2 + norms  # one rank's shards
    assert any("tensor_parallel_degree 2" in n for n in profile.notes)
    profile.check_tensor_parallel(2)  # a job at the same degree is simulated
    job = ["--torchtitan-config", "llama3:llama3_debugmodel", "--parallelism.pipeline_parallel_degree", "2"]
    other = runner.invoke(app, ["simulate", "--profile", str(path), *job])
    assert other.exit_code == 2 and "measured at tensor_parallel_degree 2, the job runs 1" in other.output


@pytest.mark.parametrize("fresh", [True, False])
def test_fresh_gradients_hold_one_copy_instead_of_accumulating(fresh: bool) -> None:
    from ppsim.calibrate.measure.harness import StageBench, unit_of

    source = parse_model_source("torchtitan:llama3/debugmodel", TINY)
    bench = StageBench(source.config, 1, 0, device=torch.device("cpu"), unit=unit_of("l", (0,)), source=source,
                       random_weights=True, fresh_grads=fresh)
    bench.backward(bench.forward())
    first = [p.grad.clone() for p in bench.module.parameters()]
    bench.backward(bench.forward())
    for p, g in zip(bench.module.parameters(), first):
        assert torch.allclose(p.grad, g if fresh else 2 * g, rtol=1e-4, atol=1e-6)
