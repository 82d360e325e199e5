"""`ppsim calibrate`: the model it measures, the per-stage measurements, p2p, resume, errors (CPU, gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from one_line import one_line_error
from processes import alive, descendants
from typer.testing import CliRunner

from ppsim.calibrate.measure.comm import fit_alpha_beta, p2p_sizes
from ppsim.cli import app
from ppsim.io import progress_path
from ppsim.profile import load_profile

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]

# Small shapes: every test here shares two cores with other work.
SMALL = ["--hidden", "32", "--heads", "2", "--ffn", "64", "--layers", "4", "--vocab", "64", "--seq-len", "16",
         "--mb-size", "2"]


# --- without torch: sizes and the alpha/beta fit ----------------------------------------------------------------------
def test_fit_recovers_alpha_and_beta_from_exact_times() -> None:
    sizes = p2p_sizes(1 << 20)
    alpha, beta = 25e-6, 3e9
    a, b, err = fit_alpha_beta(sizes, [alpha + n / beta for n in sizes])
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9) and err < 1e-9


def test_fit_reports_relative_error_of_noisy_times() -> None:
    sizes = [4, 1024, 65536, 1 << 20]
    times = [(1e-5 + n / 1e9) * f for n, f in zip(sizes, (1.2, 0.8, 1.2, 0.8))]
    a, b, err = fit_alpha_beta(sizes, times)
    assert a >= 0 and b > 0 and 0.1 < err < 0.3


def test_a_flat_or_falling_fit_keeps_the_lowest_bandwidth_the_samples_allow() -> None:
    # CI, 2026-11-27: a stalled 4 KiB all-to-all outlasted the 1 MiB one; the fit gave 1.8 TB/s over loopback
    sizes = [4096, 65536, 1 << 20]
    times = [1.1e-3, 0.9e-3, 0.578e-3]
    a, b, err = fit_alpha_beta(sizes, times)
    assert b == pytest.approx((1 << 20) / 0.578e-3)  # 1.8 GB/s: the 1 MiB in its own time
    assert 0 <= a <= max(times) and err >= 0
    assert a + (1 << 30) / b >= 1024 * 0.578e-3  # 1 GiB is extrapolated no faster than the samples show


def test_p2p_sizes_reach_beyond_the_boundary_tensor() -> None:
    sizes = p2p_sizes(3 << 20)
    assert sizes[0] <= 8 and sizes[-1] >= 4 * (3 << 20) and (3 << 20) in sizes and sizes == sorted(set(sizes))


# --- torch -----------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ppsim.calibrate.measure import harness  # noqa: E402
from ppsim.calibrate.models.transformer import (  # noqa: E402
    ModelConfig,
    build_full_model,
    build_stage_modules,
    loss_fn,
    make_batch,
    split_layers,
)


def small_config(**changes: int) -> ModelConfig:
    base = dict(hidden=32, heads=2, ffn=64, layers=4, vocab=64, seq_len=16, mb_size=2)
    base.update(changes)
    return ModelConfig(preset="custom", **base)


def test_stages_chained_equal_the_full_model() -> None:
    config = small_config(layers=5)
    tokens, targets = make_batch(config, 2)
    x = tokens[: config.mb_size]
    y = x
    stages = build_stage_modules(config, 3)
    for st in stages:
        y = st(y)
    assert stages[0].embedding is not None and stages[-1].head is not None
    assert all(st.embedding is None for st in stages[1:]) and all(st.head is None for st in stages[:-1])
    assert torch.equal(y, build_full_model(config)(x))
    assert loss_fn(y, targets[: config.mb_size]).item() > 0


def test_layers_split_as_evenly_as_possible() -> None:
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            ranges = split_layers(layers, stages)
            sizes = [b - a for a, b in ranges]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(r[1] == n[0] for r, n in zip(ranges, ranges[1:]))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_activation_bytes_scale_with_the_microbatch() -> None:
    cpu = torch.device("cpu")
    small = harness.StageBench(small_config(mb_size=2), 2, 1, device=cpu).measure_memory()
    large = harness.StageBench(small_config(mb_size=4), 2, 1, device=cpu).measure_memory()
    assert 1.9 < large.activation_bytes / small.activation_bytes <= 2.0
    first = harness.StageBench(small_config(), 2, 0, device=cpu).measure_memory()
    assert first.activation_bytes_freed_by_I == 0  # the runtime's I does nothing on the first stage


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real tiny preset (4 stages) with few repetitions, no p2p and no runtime probe, plus direct stage
    measurements to check the composition."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.json"
    result = runner.invoke(app, ["calibrate", "-o", str(path), "--reps", "5", "--warmup", "1", "--no-p2p",
                                 "--no-probe", "--check-stages"])
    assert result.exit_code == 0, result.output
    return path


def test_tiny_preset_calibrates_blocks_and_composes_stages(tiny_profile: Path) -> None:
    path = tiny_profile
    profile = load_profile(path)
    doc = json.loads(path.read_text())
    assert profile.complete and doc["version"] == 3 and profile.model.preset == "tiny"
    assert profile.p2p is None and any("--no-p2p" in n for n in profile.notes)
    assert profile.torch_version == torch.__version__ and profile.device == "cpu" and profile.created.endswith("Z")
    assert set(doc["blocks"]) == {"embed", "layer", "head"} and doc["layout"][0] == "embed"
    assert doc["layout"].count("layer") == 8 and doc["layout"][-1] == "head"
    for name, block in doc["blocks"].items():
        for op in ("F", "B", "I", "W", "FB"):
            stat = block[op]
            assert stat["n"] == 5 and 0 <= stat["p10"] <= stat["median"] <= stat["p90"], (name, op)
        assert block["param_bytes"] > 0
    assert doc["blocks"]["layer"]["activation_bytes"] > 0 and doc["blocks"]["head"]["activation_bytes_freed_by_I"] > 0
    assert doc["blocks"]["head"]["output_bytes"] == 0 and doc["blocks"]["layer"]["output_bytes"] == 4 * 128 * 128 * 4
    assert set(doc["stage_overhead"]) == {"F", "B", "I", "W", "FB"}
    # --check-stages: the 4 stages of torchtitan's default split measured whole
    assert [st.layers for st in profile.stages] == [(0, 2), (2, 5), (5, 7), (7, 8)]
    assert [st.has_embedding for st in profile.stages] == [True, False, False, False]
    assert profile.stages[0].I.median < 0.1 * profile.stages[0].W.median  # the runtime's I does nothing there
    assert sum("composed from blocks vs measured whole" in n for n in profile.notes) == 4


def _composed(path: Path, schedule: str, ranks: int) -> object:
    from ppsim.costs import load_costs
    from ppsim.schedules import get_schedule

    return load_costs(profile=path).for_schedule(get_schedule(schedule, ranks, 2 * ranks))


def test_composition_matches_directly_measured_stages(tiny_profile: Path) -> None:
    """Activation and parameter bytes compose exactly; times compose within the noise of a shared machine (loose
    bound: the benchmark reports the real error)."""
    profile = load_profile(tiny_profile)
    costs = _composed(tiny_profile, "GPipe", 4)
    assert costs.split_counts == (2, 3, 2, 1)  # type: ignore[attr-defined]
    for s, st in enumerate(profile.stages):
        assert costs.activation_bytes[s] == pytest.approx(st.activation_bytes, rel=0.01)  # type: ignore[attr-defined]
        assert costs.activation_bytes_freed_by_I[s] == pytest.approx(  # type: ignore[attr-defined]
            st.activation_bytes_freed_by_I, rel=0.01, abs=1024)
        assert costs.static_bytes[s] == st.param_bytes + st.grad_bytes + st.optimizer_bytes  # type: ignore[attr-defined]
        composed = costs.F[s] + costs.B[s] + costs.FB[s]  # type: ignore[attr-defined]
        direct = st.F.median + st.B.median + st.FB.median
        assert 0.3 * direct <= composed <= 3 * direct, (s, composed, direct)


def test_profile_drives_simulate(tiny_profile: Path) -> None:
    path = tiny_profile
    result = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    costs = _composed(path, "1F1B", 4)
    slowest_chain = sum(costs.F) + sum(costs.B)  # type: ignore[attr-defined]
    assert data["costs"]["unit"] == "s" and data["makespan"] >= slowest_chain
    assert all(r["peak_memory_bytes"] > 0 for r in data["per_rank"])


def test_one_profile_serves_2_4_and_8_stage_schedules(tiny_profile: Path) -> None:
    spans = {}
    for schedule, ranks, stages in (("1F1B", 2, 2), ("1F1B", 4, 4), ("DualPipeV", 4, 8), ("ZBVZeroBubble", 2, 4)):
        result = runner.invoke(app, ["simulate", "-s", schedule, "-r", str(ranks), "-m", "8", "--profile",
                                     str(tiny_profile), "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["stages"] == stages and data["makespan"] > 0
        spans[(schedule, ranks)] = data["makespan"]
    assert len(set(spans.values())) == len(spans)


def test_killed_calibration_resumes_the_runtime_probe_without_remeasuring(tmp_path: Path) -> None:
    out = tmp_path / "resume.json"
    path = progress_path(out)  # the unfinished profile; -o is written only when it is finished
    args = ["calibrate", "-o", str(out), *SMALL, "--stages", "2", "--reps", "3", "--warmup", "1", "--no-p2p"]
    proc = subprocess.Popen([sys.executable, "-m", "ppsim.cli", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= descendants(proc.pid)
            if path.exists():
                try:
                    data = json.loads(path.read_text())
                except ValueError:
                    continue
                if "runtime.real" in data["done"]:
                    seen |= descendants(proc.pid)
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    partial = json.loads(path.read_text())
    assert not partial["complete"], "the calibration finished before it could be killed"
    assert partial["done"] == ["units", "runtime.real"]
    wait_until = time.monotonic() + 15
    while alive(seen) and time.monotonic() < wait_until:
        time.sleep(0.2)
    assert not alive(seen), "processes of the killed calibration are still running"
    assert "incomplete" in one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "2", "-m", "4",
                                                              "--profile", str(path)]))

    assert not out.exists()
    result = runner.invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert not path.exists()
    final = json.loads(out.read_text())
    assert final["complete"] and final["done"] == ["units", "runtime.real", "runtime.synthetic"]
    assert final["units"] == partial["units"]  # kept, not measured again
    for key in ("compute_scale", "dispatch_s", "handoff_s", "samples"):
        assert final["runtime"][key] == partial["runtime"][key]
    assert partial["runtime"]["synthetic"] is None and final["runtime"]["synthetic"]["dispatch_s"] >= 0
    assert final["runtime"]["compute_scale"]["2"] > 0 and final["runtime"]["probe"]["schedule"] == "1F1B"
    assert load_profile(out).runtime is not None
    assert "measuring" not in result.output and "runtime probe (real)" not in result.output
    again = runner.invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and "already complete" in again.output


def test_resume_with_other_options_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    assert runner.invoke(app, ["calibrate", "-o", str(path), *SMALL, "--stages", "1", "--reps", "1",
                               "--warmup", "0", "--no-p2p", "--no-probe"]).exit_code == 0
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(path), *SMALL, "--stages", "1", "--reps", "2",
                                              "--warmup", "0", "--no-p2p", "--no-probe", "--resume"]))
    assert "reps 1, not 2" in line and "--resume" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--stages", "11", "--check-stages"], "11 stages for 8 layers"),
        (["--stages", "0"], "--stages 0"),
        (["--reps", "0"], "--reps 0"),
        (["--warmup", "-1"], "--warmup -1"),
        (["--hidden", "100", "--heads", "3"], "divisible by heads"),
        (["--preset", "70b"], "unknown preset"),
        (["--mb-size", "0"], "--mb-size 0"),
        (["--init-timeout", "0"], "--init-timeout"),
        (["--seq-len", "10000000"], "--allow-large"),
        (["--preset", "8b"], "--allow-large"),
    ],
)
def test_bad_options_give_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                                   expected: str) -> None:
    from ppsim.calibrate.measure import speed

    monkeypatch.setattr(speed, "matmul_flops_per_s", lambda *args: 20e9)  # the estimate independent of the host
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), *args]))
    assert expected in line
    assert not (tmp_path / "p.json").exists()


def test_bad_output_paths_give_one_line(tmp_path: Path) -> None:
    assert "does not exist" in one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "no" / "p.json")]))
    assert "is a directory" in one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path)]))
    assert ".json" in one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.txt")]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without CUDA")
def test_cuda_without_cuda_gives_one_line(tmp_path: Path) -> None:
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), "--device", "cuda"]))
    assert "CUDA is not available" in line and "--device cpu" in line


def test_out_of_memory_names_the_shape_and_a_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def exhausted(self: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(harness.StageBench, "measure_memory", exhausted)
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), *SMALL, "--stages", "2",
                                              "--reps", "1", "--warmup", "0", "--no-p2p"]))
    assert "out of memory measuring memory" in line and "2x16" in line and "--mb-size" in line
    assert load_profile(progress_path(tmp_path / "p.json"), allow_incomplete=True).done == ()
    assert not (tmp_path / "p.json").exists()


def test_unreachable_peer_times_out_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.measure.comm import free_port

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(tmp_path / "p.json"), *SMALL,
                                              "--init-timeout", "2"]))
    assert "could not form the gloo process group within 2 s" in line and "--init-timeout" in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_calibration_records_allocator_bytes(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    result = runner.invoke(app, ["calibrate", "-o", str(path), "--device", "cuda", *SMALL, "--stages", "2",
                                 "--reps", "3", "--warmup", "1"])
    assert result.exit_code == 0, result.output
    profile = load_profile(path)
    assert profile.device == "cuda" and profile.method is not None and profile.method.timer == "cuda_events"
    # cuBLAS's workspaces (the forward's thread and autograd's) are measured for the memory prediction
    assert profile.method.workspace_bytes is not None and profile.method.workspace_bytes > 0
    for st in profile.stages:
        assert st.F.median > 0 and st.activation_bytes_allocator is not None and st.peak_bytes_allocator > 0


def test_an_unknown_torch_release_is_refused_by_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.execute import torch_adapter
    from ppsim.errors import PPSimError

    monkeypatch.setattr(torch_adapter, "_checked", False)
    monkeypatch.setattr(torch, "__version__", "9.1.0")
    monkeypatch.delenv(torch_adapter.OVERRIDE_ENV, raising=False)
    with pytest.raises(PPSimError, match=r"torch 9\.1\.0: .*tested with torch 2\.13.*PPSIM_UNTESTED_TORCH=1"):
        torch_adapter.check()
    monkeypatch.setenv(torch_adapter.OVERRIDE_ENV, "1")
    torch_adapter.check()  # the names it needs are all there: allowed with the override


def test_an_older_torch_is_refused_in_one_line_naming_the_releases_that_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.execute import torch_adapter
    from ppsim.errors import PPSimError

    monkeypatch.setattr(torch_adapter, "_checked", False)
    monkeypatch.setattr(torch, "__version__", "2.12.1+cpu")
    monkeypatch.setenv(torch_adapter.OVERRIDE_ENV, "1")  # the override does not lift it: older releases lack names
    with pytest.raises(PPSimError, match=r"torch 2\.12\.1\+cpu: .*needs torch 2\.13, 2\.14, 2\.15") as info:
        torch_adapter.check()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1", "2.15.0"])
def test_the_tested_torch_releases_run_without_the_override(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str], version: str) -> None:
    from ppsim.calibrate.execute import torch_adapter

    monkeypatch.delenv(torch_adapter.OVERRIDE_ENV, raising=False)
    torch_adapter._check_version(version)
    assert capsys.readouterr().err == ""


def test_a_newer_untested_torch_runs_with_the_override_and_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from ppsim.calibrate.execute import torch_adapter

    monkeypatch.setenv(torch_adapter.OVERRIDE_ENV, "1")
    monkeypatch.delenv("RANK", raising=False)
    torch_adapter._check_version("2.16.0")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch 2.16.0 is newer" in err and "2.13, 2.14, 2.15" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "-s", "1F1B", "-r", "0", "-m", "2"],
        ["run", "-s", "1F1B", "-r", "2", "-m", "1000000000"],
        ["calibrate", "-o", "p.json", "--reps", "0"],
        ["calibrate", "-o", "p.json", "--seq-len", "10000000"],
    ],
)
def test_bad_options_are_refused_before_torch_is_imported(tmp_path: Path, argv: list[str]) -> None:
    code = ("import sys\nfrom ppsim.cli import main\nsys.argv = ['ppsim', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "exit 2 False", out.stdout + out.stderr
    assert out.stderr.startswith("Error: ") and out.stderr.count("\n") == 1


def test_the_allocator_workspace_is_not_measured_on_cpu(tmp_path: Path) -> None:
    """CPU has no caching allocator whose library workspaces a step would keep: the profile records none."""
    from ppsim.calibrate.measure.workspace import allocator_workspace_bytes

    assert allocator_workspace_bytes(torch.device("cpu"), torch.float32) is None
