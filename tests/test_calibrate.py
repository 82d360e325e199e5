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
from typer.testing import CliRunner

from ppsim.calibrate.comm import fit_alpha_beta, p2p_sizes
from ppsim.cli import app
from ppsim.profile import load_profile

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent

# Small shapes: every test here shares two cores with other work.
SMALL = ["--hidden", "32", "--heads", "2", "--ffn", "64", "--layers", "4", "--vocab", "64", "--seq-len", "16",
         "--mb-size", "2"]
I_PLUS_W_TOLERANCE = (0.6, 2.5)
"""Sum over stages of I + W against B. On CPU, I + W runs 10-60% above B: torch's input pass keeps the whole graph
(retain_graph) so its buffers come from fresh memory, and it walks the graph in Python first (docs/calibration.md)."""


def one_line_error(result: object) -> str:
    """Exit 2 with exactly one error line and no traceback (progress lines before it are fine)."""
    output = result.output  # type: ignore[attr-defined]
    assert result.exit_code == 2, output  # type: ignore[attr-defined]
    errors = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert output.rstrip().endswith(errors[0]), output
    return errors[0]


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


def test_p2p_sizes_reach_beyond_the_boundary_tensor() -> None:
    sizes = p2p_sizes(3 << 20)
    assert sizes[0] <= 8 and sizes[-1] >= 4 * (3 << 20) and (3 << 20) in sizes and sizes == sorted(set(sizes))


# --- torch -----------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ppsim.calibrate import harness  # noqa: E402
from ppsim.calibrate.model import (  # noqa: E402
    PRESETS, ModelConfig, build_full_model, build_stage_modules, loss_fn, make_batch, split_layers,
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
def tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The real tiny preset (4 stages) with few repetitions and no p2p, to keep this file quick; the defaults
    (20 repetitions, p2p) take 35-45 s on a busy 2-core CPU."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.json"
    start = time.perf_counter()
    result = runner.invoke(app, ["calibrate", "-o", str(path), "--reps", "5", "--warmup", "1", "--no-p2p"])
    assert result.exit_code == 0, result.output
    return path, time.perf_counter() - start


def test_tiny_preset_calibrates_quickly_with_every_field_positive(tiny_profile: tuple[Path, float]) -> None:
    path, _wall = tiny_profile
    profile = load_profile(path)
    assert profile.complete and profile.num_stages == 4 and profile.model.preset == "tiny"
    assert profile.p2p is None and any("--no-p2p" in n for n in profile.notes)
    assert profile.torch_version == torch.__version__ and profile.device == "cpu" and profile.created.endswith("Z")
    assert profile.model.hidden == PRESETS["tiny"].hidden
    for st in profile.stages:
        for op in ("F", "B", "I", "W", "FB"):
            stat = getattr(st, op)
            assert stat.n == 5 and len(stat.samples) == 5 and 0 < stat.p10 <= stat.median <= stat.p90
        assert st.activation_bytes > 0 and st.param_bytes > 0 and st.grad_bytes > 0 and st.optimizer_bytes > 0
        assert 0 <= st.activation_bytes_freed_by_I <= st.activation_bytes
        assert st.output_bytes == (0 if st.has_head else 4 * 128 * 128 * 4)
    assert [st.has_embedding for st in profile.stages] == [True, False, False, False]
    assert [st.layers for st in profile.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    total_b = sum(st.B.median for st in profile.stages)
    total_iw = sum(st.I.median + st.W.median for st in profile.stages)
    low, high = I_PLUS_W_TOLERANCE
    assert low * total_b <= total_iw <= high * total_b
    total_fb = sum(st.FB.median for st in profile.stages)
    assert 0.6 * (total_b + sum(st.F.median for st in profile.stages)) <= total_fb  # a pair is an F then a B


def test_profile_drives_simulate(tiny_profile: tuple[Path, float]) -> None:
    path, _ = tiny_profile
    profile = load_profile(path)
    result = runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "8", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    slowest_chain = sum(st.F.median + st.B.median for st in profile.stages)
    assert data["costs"]["unit"] == "s" and data["makespan"] >= slowest_chain
    assert all(r["peak_memory_bytes"] > 0 for r in data["per_rank"])
    result = runner.invoke(app, ["simulate", "-s", "ZBVZeroBubble", "-r", "2", "-m", "4", "--profile", str(path)])
    assert result.exit_code == 0, result.output
    mismatch = one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "3", "-m", "6",
                                                  "--profile", str(path)]))
    assert "4 stages" in mismatch


def test_two_local_processes_measure_alpha_and_beta(tmp_path: Path) -> None:
    path = tmp_path / "p2p.json"
    result = runner.invoke(app, ["calibrate", "-o", str(path), *SMALL, "--stages", "1", "--reps", "3",
                                 "--warmup", "1"])
    assert result.exit_code == 0, result.output
    p2p = load_profile(path).p2p
    assert p2p is not None and p2p.measured
    assert p2p.alpha_s > 0 and p2p.beta_bytes_per_s > 0 and p2p.fit_rel_error >= 0
    sizes = [s.bytes for s in p2p.samples]
    assert sizes[0] <= 8 and sizes[-1] >= 4 * 2 * 16 * 32 * 4
    assert all(0 < s.p10_s <= s.median_s <= s.p90_s for s in p2p.samples)
    assert p2p.pairs and (p2p.pairs[0].src, p2p.pairs[0].dst) == (0, 1)


def test_killed_calibration_resumes_without_remeasuring(tmp_path: Path) -> None:
    path = tmp_path / "resume.json"
    args = ["calibrate", "-o", str(path), "--stages", "4", "--reps", "6", "--warmup", "1", "--no-p2p",
            "--hidden", "64", "--ffn", "176", "--seq-len", "64"]
    proc = subprocess.Popen([sys.executable, "-m", "ppsim.cli", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists():
                data = json.loads(path.read_text())
                if "stage0.memory" in data["done"]:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    partial = load_profile(path, allow_incomplete=True)
    assert not partial.complete, "the calibration finished before it could be killed"
    assert {"stage0.timings", "stage0.memory"} <= set(partial.done)
    assert "incomplete" in one_line_error(runner.invoke(app, ["simulate", "-s", "1F1B", "-r", "4", "-m", "4",
                                                              "--profile", str(path)]))

    result = runner.invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    final = load_profile(path)
    assert final.complete and final.done[: len(partial.done)] == partial.done
    assert len(final.done) == len(set(final.done)) == 4 * 2
    for old, new in zip(partial.stages, final.stages):
        for op in ("F", "B", "I", "W", "FB"):
            if getattr(old, op) is not None:
                assert getattr(new, op) == getattr(old, op)  # kept, not measured again
    assert "stage 0" not in result.output and "stage 3 timings" in result.output
    again = runner.invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and "already complete" in again.output
    assert load_profile(path) == final


def test_resume_with_other_options_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    assert runner.invoke(app, ["calibrate", "-o", str(path), *SMALL, "--stages", "1", "--reps", "1",
                               "--warmup", "0", "--no-p2p"]).exit_code == 0
    line = one_line_error(runner.invoke(app, ["calibrate", "-o", str(path), *SMALL, "--stages", "2", "--reps", "1",
                                              "--warmup", "0", "--no-p2p", "--resume"]))
    assert "stages 1, not 2" in line and "--resume" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--stages", "9"], "--stages 9 with --layers 8"),
        (["--stages", "0"], "--stages 0"),
        (["--reps", "0"], "--reps 0"),
        (["--warmup", "-1"], "--warmup -1"),
        (["--hidden", "100", "--heads", "3"], "divisible by heads"),
        (["--preset", "70b"], "unknown preset"),
        (["--mb-size", "0"], "--mb-size 0"),
        (["--init-timeout", "0"], "--init-timeout"),
    ],
)
def test_bad_options_give_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
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
    assert "out of memory measuring memory of stage 0" in line and "2x16" in line and "--mb-size" in line
    assert load_profile(tmp_path / "p.json", allow_incomplete=True).done == ("stage0.timings",)


def test_unreachable_peer_times_out_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppsim.calibrate.comm import free_port

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
    for st in profile.stages:
        assert st.F.median > 0 and st.activation_bytes_allocator is not None and st.peak_bytes_allocator > 0
