"""`ppsim run`: execution with torch's pipeline runtime, numerics against a reference, timing, comparison."""

from __future__ import annotations

import json
import math
import multiprocessing
from pathlib import Path

import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from ppsim import deps  # noqa: E402
from ppsim.cli import app  # noqa: E402
from ppsim.ir import parse_action  # noqa: E402
from ppsim.profile import ModelInfo, Profile, StageProfile, Stat, save_profile  # noqa: E402
from ppsim.schedules import get_schedule  # noqa: E402

pytestmark = pytest.mark.torch

CONTRACT_KEYS = {
    "schedule", "ranks", "microbatches", "backend", "device", "grad_max_abs_diff", "loss_match",
    "measured_step_s", "predicted_step_s", "step_error_pct", "per_action",
}
ACTION_KEYS = {"rank", "action", "start_s", "end_s", "predicted_start_s", "predicted_end_s"}
# A small model: every run in this file takes a second or two of compute.
SMALL = ModelInfo(preset="custom", hidden=16, heads=2, ffn=32, layers=4, vocab=32, seq_len=8, mb_size=1,
                  dtype="float32")
FAST = ["--steps", "2", "--warmup", "1", "--timeout", "120"]


def stat(seconds: float) -> Stat:
    return Stat.from_samples([seconds])


def write_profile(path: Path, num_stages: int, *, model: ModelInfo = SMALL) -> Path:
    """A complete profile of ``model`` with plausible made-up costs (the tests check execution, not accuracy)."""
    from ppsim.calibrate.model import split_layers

    ranges = split_layers(model.layers, num_stages)
    stages = tuple(
        StageProfile(
            stage=s, layers=ranges[s], has_embedding=s == 0, has_head=s == num_stages - 1, param_bytes=4096,
            grad_bytes=4096, optimizer_bytes=8192, output_bytes=0 if s == num_stages - 1 else 512,
            F=stat(1e-3), B=stat(2e-3), I=stat(1e-3), W=stat(1e-3), FB=stat(3e-3), activation_bytes=10_000,
            activation_bytes_freed_by_I=1_000,
        )
        for s in range(num_stages)
    )
    profile = Profile(
        created="2026-11-22T10:00:00Z", device="cpu", device_name="test", torch_version="test", host="test",
        world_size=1, backend=None, model=model, num_stages=num_stages, stages=stages, p2p=None, complete=True,
    )
    save_profile(profile, path)
    return path


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["run", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def check_run_json(path: Path, schedule_name: str, num_ranks: int, num_microbatches: int, **kw: int) -> dict:
    """The run JSON: keys, numerics within tolerance, every action timed, causality across ranks."""
    data = json.loads(path.read_text())
    assert CONTRACT_KEYS <= data.keys()
    assert data["grad_ok"] and data["loss_match"]
    assert data["grad_max_abs_diff"] <= data["grad_tolerance"]
    assert math.isfinite(data["predicted_step_s"]) and data["predicted_step_s"] > 0
    assert data["measured_step_s"] > 0
    schedule = get_schedule(schedule_name, num_ranks, num_microbatches, kw.get("v"))
    actions = data["per_action"]
    assert [(a["rank"], a["action"]) for a in actions] == [
        (r, str(a)) for r, row in enumerate(schedule.actions) for a in row
    ]
    for a in actions:
        assert ACTION_KEYS <= a.keys()
        assert 0 <= a["start_s"] < a["end_s"] and 0 <= a["predicted_start_s"] < a["predicted_end_s"]
    # a computation never starts before the cross-rank input it needs was produced (one clock for all ranks)
    ends = {}
    for a in actions:
        for half in a.get("halves", [a]):
            for key in deps.provides(parse_action(half["action"])):
                ends[key] = (a["rank"], a["end_s"])
    for a in actions:
        for half in a.get("halves", [a]):
            for key in deps.requires(schedule, parse_action(half["action"])):
                rank, produced = ends[key]
                if rank != a["rank"]:
                    assert half["start_s"] >= produced, (half, key)
    # no temporary file left beside the atomically written JSON
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert multiprocessing.active_children() == []
    return data


@pytest.mark.slow
def test_one_rank_runs_with_no_communication_and_draws_the_comparison(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "p1.json", 1)
    out, fig = tmp_path / "run.json", tmp_path / "run.png"
    code, stdout, stderr = invoke("-s", "1F1B", "-r", "1", "-m", "3", "--profile", str(profile), "-o", str(out),
                                  "--plot", str(fig), *FAST)
    assert code == 0, stderr
    data = check_run_json(out, "1F1B", 1, 3)
    assert all(a["wait_s"] == 0 for a in data["per_action"])  # nothing to receive
    assert data["runtime_model"]["num_latency_samples"] == 0
    assert fig.stat().st_size > 0 and "numerics OK" in stdout


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "num_stages"), [("1F1B", 2), ("ZBH1", 2), ("DualPipeV", 4)])
def test_two_rank_run_matches_the_reference_and_times_every_action(
    tmp_path: Path, schedule: str, num_stages: int
) -> None:
    profile = write_profile(tmp_path / "p.json", num_stages)
    out = tmp_path / "run.json"
    code, _, stderr = invoke("-s", schedule, "-r", "2", "-m", "4", "--profile", str(profile), "-o", str(out), *FAST)
    assert code == 0, stderr
    data = check_run_json(out, schedule, 2, 4)
    first_on_rank1 = next(a for a in data["per_action"] if a["rank"] == 1)
    assert first_on_rank1["wait_s"] > 0  # rank 1 starts by waiting for rank 0's first forward
    if schedule == "DualPipeV":
        assert any("halves" in a for a in data["per_action"])  # overlapped pairs run (as two halves)


@pytest.mark.slow
def test_synthetic_interleaved_four_ranks_sleeps_each_cost(tmp_path: Path) -> None:
    out, fig = tmp_path / "run.json", tmp_path / "run.html"
    unit = 0.004
    code, _, stderr = invoke("-s", "Interleaved1F1B", "-r", "4", "-m", "4", "--synthetic", "--costs", "F=1,B=2",
                             "--time-unit", str(unit), "-o", str(out), "--plot", str(fig), *FAST)
    assert code == 0, stderr
    data = check_run_json(out, "Interleaved1F1B", 4, 4)
    assert data["synthetic"] and data["stages"] == 8
    for a in data["per_action"]:
        cost = unit * (1 if "F" in a["action"] else 2)
        assert a["end_s"] - a["start_s"] >= cost * 0.999  # each computation lasts at least its cost
    assert "plotly" in fig.read_text()[:100_000].lower()


def test_dualpipe_is_refused_with_the_reason(tmp_path: Path) -> None:
    code, _, stderr = invoke("-s", "DualPipe", "-r", "2", "-m", "4", "--synthetic")
    assert code == 2
    line = stderr.strip()
    assert "\n" not in line and "cannot execute" in line and "chain the two pipelines" in line


@pytest.mark.parametrize(
    "args",
    [
        ["-s", "DualPipeV", "-r", "4", "-m", "4", "--synthetic"],  # more ranks than 4 microbatches allow
        ["-s", "1F1B", "-r", "16", "-m", "16"],  # more ranks than the model has layers (checked before calibrating)
        ["-s", "1F1B", "-r", "2", "-m", "2", "--costs", "F=1"],  # a cost string needs --synthetic
        ["-s", "1F1B", "-r", "2", "-m", "2", "--plot", "x.gif", "--synthetic"],
    ],
)
def test_bad_configurations_fail_with_one_line(args: list[str]) -> None:
    code, stdout, stderr = invoke(*args)
    assert code == 2
    assert stderr.startswith("Error: ") and stderr.count("\n") == 1 and "Traceback" not in stderr + stdout


def test_profile_with_another_stage_count_fails_with_one_line(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "p2.json", 2)
    code, _, stderr = invoke("-s", "1F1B", "-r", "4", "-m", "4", "--profile", str(profile))
    assert code == 2 and stderr.count("\n") == 1
    assert "profile has 2 stages" in stderr and "--stages 4" in stderr


def test_missing_profile_file_fails_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    code, _, stderr = invoke("-s", "1F1B", "-r", "2", "-m", "2", "--profile", str(missing))
    assert code == 2 and stderr.count("\n") == 1 and str(missing) in stderr


@pytest.mark.slow
def test_timeout_stops_every_process(tmp_path: Path) -> None:
    code, _, stderr = invoke("-s", "GPipe", "-r", "2", "-m", "4", "--synthetic", "--costs", "F=1,B=1",
                             "--time-unit", "1", "--timeout", "3")
    assert code == 2 and "did not finish within 3 s" in stderr
    assert multiprocessing.active_children() == []


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_run_times_actions_with_cuda_events(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    profile = tmp_path / "p.json"
    save_profile(Profile.from_dict(json.loads(write_profile(profile, 2).read_text()) | {"device": "cuda"}), profile)
    out = tmp_path / "run.json"
    code, _, stderr = invoke("-s", "1F1B", "-r", "2", "-m", "4", "--backend", "nccl", "--profile", str(profile),
                             "-o", str(out), *FAST)
    assert code == 0, stderr
    data = check_run_json(out, "1F1B", 2, 4)
    assert data["clock"] == "cuda_events" and data["device"] == "cuda"


# --- the runtime model, on hand-made timings (no processes) -----------------------------------------------------
def _timing(rank: int, position: int, name: str, start: float, end: float, wait: float = 0.0, half: int = 0):
    from ppsim.calibrate.executor import CompTiming

    return CompTiming(rank, position, half, name, start, end, wait)


def _measurement(warmup: tuple, steps: tuple, *, synthetic: bool = False, probes: tuple = ()):
    from ppsim.calibrate.executor import Measurement

    return Measurement(
        steps=steps, step_walls=(1.0,) * len(steps), warmup_steps=warmup, probe_steps=probes, loss=1.0, ref_loss=1.0,
        grad_max_abs_diff=0.0, grad_ref_max_abs=1.0, num_params_checked=1, dtype="float32", device="cpu",
        device_name="cpu", backend="gloo", torch_version="x", hosts=("h",), clock="perf_counter",
        num_warmup=len(warmup), synthetic=synthetic,
    )


def test_runtime_model_fits_dispatch_latency_and_compute_scale_on_warmup_only() -> None:
    from ppsim.calibrate.runtime_model import fit_runtime_model
    from ppsim.costs import parse_costs

    schedule = get_schedule("GPipe", 2, 1)  # rank 0: 0F0 0B0; rank 1: 1F0 1B0
    costs = parse_costs("F=1,B=2")
    # every computation runs 2x its cost; the gaps without waits are 0.1 (dispatch); 1F0 and 0B0 wait for their
    # input and start 0.3 after it left, i.e. 0.2 of latency on top of the dispatch
    step = (
        _timing(0, 0, "0F0", 0.0, 2.0),
        _timing(0, 1, "0B0", 8.7, 12.7, wait=6.6),
        _timing(1, 0, "1F0", 2.3, 4.3, wait=2.0),
        _timing(1, 1, "1B0", 4.4, 8.4),
    )
    # the first warm-up step is skipped (set-up) and the timed steps are never used: both hold other numbers
    junk = tuple(_timing(c.rank, c.position, c.name, c.start * 3, c.end * 3 + 1, c.wait) for c in step)
    model = fit_runtime_model(_measurement((junk, step), (junk,)), schedule, costs)
    assert model is not None
    assert model.compute_scale == pytest.approx((2.0,))
    assert model.dispatch_s == pytest.approx(0.1) and model.overrun_s == 0
    assert model.latency_s == pytest.approx(0.2) and model.num_latency_samples == 2
    assert fit_runtime_model(_measurement((), (step,)), schedule, costs) is None  # no warm-up, no fit
    # probe steps, when there are any, are what the model is fitted on
    probed = fit_runtime_model(_measurement((junk, junk), (junk,), probes=(step, step, junk)), schedule, costs)
    assert probed is not None and probed.fitted_on == "3 probe step(s)"
    assert probed.compute_scale == pytest.approx((2.0,)) and probed.dispatch_s == pytest.approx(0.1)  # medians


def test_synthetic_runtime_model_adds_the_sleep_overrun_to_dispatch() -> None:
    from ppsim.calibrate.runtime_model import fit_runtime_model
    from ppsim.costs import parse_costs

    schedule = get_schedule("GPipe", 1, 2)  # 0F0 0F1 0B0 0B1
    costs = parse_costs("F=1,B=2")
    step = (
        _timing(0, 0, "0F0", 0.0, 1.1),
        _timing(0, 1, "0F1", 1.2, 2.3),
        _timing(0, 2, "0B0", 2.4, 4.5),
        _timing(0, 3, "0B1", 4.6, 6.7),
    )
    model = fit_runtime_model(_measurement((step,), (step,), synthetic=True), schedule, costs)
    assert model is not None and model.compute_scale == (1.0,)
    assert model.gap_s == pytest.approx(0.1) and model.overrun_s == pytest.approx(0.1)
    assert model.dispatch_s == pytest.approx(0.2) and model.num_latency_samples == 0


def test_with_runtime_adds_dispatch_to_every_computation_and_two_to_a_pair() -> None:
    from ppsim.calibrate.runtime_model import RuntimeModel, with_runtime
    from ppsim.costs import parse_costs

    costs = parse_costs("F=1,B=2,FB=2.5,comm=0.5")
    rt = RuntimeModel(compute_scale=(2.0,), dispatch_s=0.1, latency_s=0.3, gap_s=0.1, overrun_s=0.0,
                      num_gap_samples=4, num_latency_samples=2, comm_source="measured hand-offs",
                      fitted_on="2 probe step(s)")
    out = with_runtime(costs, rt, 0.01)
    assert out.unit == "s"
    assert out.F[0] == pytest.approx(0.02 + 0.1) and out.B[0] == pytest.approx(0.04 + 0.1)
    assert out.FB[0] == pytest.approx(0.05 + 0.2)
    assert out.comm == pytest.approx(0.3)
    plain = with_runtime(costs, None, 0.01)
    assert plain.F[0] == pytest.approx(0.01) and plain.comm == pytest.approx(0.005)
