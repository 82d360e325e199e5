"""`ppsim run`: execution with torch's pipeline runtime, numerics against a reference, timing, comparison."""

from __future__ import annotations

import json
import math
import multiprocessing
from pathlib import Path

import pytest
from processes import alive, default_signals, descendants

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
    from ppsim.calibrate.models.transformer import split_layers

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
    assert data["explained_model"]["num_latency_samples"] == 0
    assert fig.stat().st_size > 0 and "numerics OK" in stdout


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "num_stages"), [("1F1B", 2), ("ZBH1", 2), ("DualPipeV", 4), ("DualPipe", 2)])
def test_two_rank_run_matches_the_reference_and_times_every_action(
    tmp_path: Path, schedule: str, num_stages: int
) -> None:
    profile = write_profile(tmp_path / "p.json", num_stages)
    out = tmp_path / "run.json"
    code, _, stderr = invoke("-s", schedule, "-r", "2", "-m", "4", "--profile", str(profile), "-o", str(out), *FAST)
    assert code == 0, stderr
    data = check_run_json(out, schedule, 2, 4)
    # rank 1 starts by waiting for rank 0's first forward (DualPipe: rank 1 feeds chain 1, which rank 0 waits for)
    waiting = ("1F0", 1) if schedule != "DualPipe" else ("3F0", 0)
    first_input = next(a for a in data["per_action"] if (a["action"], a["rank"]) == waiting)
    assert first_input["wait_s"] > 0
    if schedule in ("DualPipeV", "DualPipe"):
        assert any("halves" in a for a in data["per_action"])  # overlapped pairs run (as two halves)
    if schedule == "DualPipe":  # two model copies of 2 stages, each profile stage used by both
        assert data["stages"] == 4


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


@pytest.mark.slow
def test_synthetic_dualpipe_on_four_ranks_runs_both_chains_and_matches_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    code, _, stderr = invoke("-s", "DualPipe", "-r", "4", "-m", "8", "--synthetic", "--costs", "F=1,B=2",
                             "--time-unit", "0.002", "-o", str(out), *FAST)
    assert code == 0, stderr
    data = check_run_json(out, "DualPipe", 4, 8)
    # the middle ranks hold neither end of a chain; every rank runs an overlapped pair
    assert {a["rank"] for a in data["per_action"] if "halves" in a} == {0, 1, 2, 3}


@pytest.mark.parametrize(("args", "says"), [(["-r", "3", "-m", "6"], "--ranks 3"), (["-r", "2", "-m", "5"], "--mb 5")])
def test_dualpipe_with_odd_ranks_or_microbatches_is_refused_in_one_line(args: list[str], says: str) -> None:
    code, _, stderr = invoke("-s", "DualPipe", *args, "--synthetic")
    assert code == 2
    line = stderr.strip()
    assert "\n" not in line and says in line and "even" in line


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
                             "--time-unit", "1", "--timeout", "3", "--allow-large")  # past the predicted-time check
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
    from ppsim.calibrate.execute.steps import CompTiming

    return CompTiming(rank, position, half, name, start, end, wait)


def _measurement(warmup: tuple, steps: tuple, *, synthetic: bool = False, probes: tuple = ()):
    from ppsim.calibrate.execute.steps import Measurement

    return Measurement(
        steps=steps, step_walls=(1.0,) * len(steps), warmup_steps=warmup, probe_steps=probes, loss=1.0, ref_loss=1.0,
        grad_max_abs_diff=0.0, grad_ref_max_abs=1.0, num_params_checked=1, dtype="float32", device="cpu",
        device_name="cpu", backend="gloo", torch_version="x", hosts=("h",), clock="perf_counter",
        num_warmup=len(warmup), synthetic=synthetic,
    )


def test_a_measured_step_ends_when_the_last_rank_leaves_the_runtimes_step_if_that_is_later() -> None:
    """The step span runs to the later of the last computation's end and the last rank's return from the runtime's
    step (under FSDP torch reduce-scatters after the last backward, inside the step, and the prediction holds it);
    without recorded ends, to the last computation's end."""
    import dataclasses

    steps = ((_timing(0, 0, "0F0", 0.0, 1.0), _timing(1, 0, "1F0", 1.0, 2.0)),
             (_timing(0, 0, "0F0", 0.0, 1.0), _timing(1, 0, "1F0", 1.0, 2.5)))
    measured = _measurement((), steps)
    assert measured.step_spans == (2.0, 2.5)
    assert dataclasses.replace(measured, step_ends=(2.75, 2.25)).step_spans == (2.75, 2.5)


def test_a_measured_step_starts_when_the_first_rank_called_the_runtimes_step() -> None:
    """Under FSDP torch's runtime starts the all-gathers when a rank calls its step and the first forward waits for
    them: the span starts at the earlier of that call and the first computation (the prediction holds the gathers)."""
    import dataclasses

    steps = ((_timing(0, 0, "0F0", 0.5, 1.0), _timing(1, 0, "1F0", 1.0, 2.0)),
             (_timing(0, 0, "0F0", 0.25, 1.0), _timing(1, 0, "1F0", 1.0, 2.5)))
    measured = _measurement((), steps)
    assert measured.step_spans == (1.5, 2.25)
    assert dataclasses.replace(measured, step_begins=(0.0, 0.5)).step_spans == (2.0, 2.25)


def test_runtime_model_fits_dispatch_latency_and_compute_scale_on_warmup_only() -> None:
    from ppsim.calibrate.measure.runtime_model import fit_runtime_model
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


def _two_rank_probe_step(alone: float, together: float) -> tuple:
    """GPipe, 2 ranks, 2 microbatches (F=1, B=2): 0F1 and 1F0 run at the same time (each x ``together``), every
    other computation runs while the other rank is idle (x ``alone``)."""
    a, t = alone, together
    r1 = a + t  # rank 1 after 1F0
    r0 = r1 + 5 * a  # rank 0's backwards, after rank 1's
    return (
        _timing(0, 0, "0F0", 0.0, a),
        _timing(0, 1, "0F1", a, a + t),
        _timing(0, 2, "0B0", r0, r0 + 2 * a),
        _timing(0, 3, "0B1", r0 + 2 * a, r0 + 4 * a),
        _timing(1, 0, "1F0", a, a + t),
        _timing(1, 1, "1F1", r1, r1 + a),
        _timing(1, 2, "1B0", r1 + a, r1 + 3 * a),
        _timing(1, 3, "1B1", r1 + 3 * a, r1 + 5 * a),
    )


@pytest.mark.parametrize(("alone", "together", "factor"), [(1.5, 1.8, 1.2), (1.0, 1.0, 1.0), (1.4, 1.26, 1.0)])
def test_probe_compute_scale_is_the_slowdown_of_computing_together(alone: float, together: float,
                                                                  factor: float) -> None:
    """The host's speed at the probe's moment (``alone``) cancels; only computing beside another rank counts, and
    it never makes a computation faster."""
    from ppsim.calibrate.measure.runtime_model import fit_probe
    from ppsim.costs import parse_costs

    schedule = get_schedule("GPipe", 2, 2)
    step = _two_rank_probe_step(alone, together)
    fitted = fit_probe(_measurement((), (step, step, step)), schedule, parse_costs("F=1,B=2"))
    assert fitted["compute_scale"] == {"1": 1.0, "2": pytest.approx(factor)}
    assert fitted["samples"]["host_scale.1"] == pytest.approx([alone] * 3)


def test_synthetic_runtime_model_adds_the_sleep_overrun_to_dispatch() -> None:
    from ppsim.calibrate.measure.runtime_model import fit_runtime_model
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
    from ppsim.calibrate.measure.runtime_model import RuntimeModel, with_runtime
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


# --- the before-run prediction ------------------------------------------------------------------------------------
RUNTIME = {"compute_scale": {"1": 1.0, "2": 1.5}, "dispatch_s": 0.001, "handoff_s": 0.002, "recv_posting": "consumer",
           "synthetic": {"compute_scale": {"1": 1.0}, "dispatch_s": 0.0005, "handoff_s": 0.001,
                         "recv_posting": "consumer", "synthetic": None, "probe": None, "samples": {}},
           "probe": {"schedule": "1F1B", "ranks": 2, "microbatches": 8, "steps": 4}, "samples": {}}


def write_block_profile(path: Path, *, model: ModelInfo = SMALL) -> Path:
    """A complete per-block (version 2) profile of ``model`` with made-up costs and a runtime section."""
    def block(f: float, params: int, out: int, act: int, freed: int = 0) -> dict:
        return {"F": stat(f).to_dict(), "B": stat(2 * f).to_dict(), "I": stat(f).to_dict(), "W": stat(f).to_dict(),
                "FB": stat(3 * f).to_dict(), "activation_bytes": act, "activation_bytes_freed_by_I": freed,
                "param_bytes": params, "grad_bytes": params, "optimizer_bytes": 2 * params, "output_bytes": out,
                "activation_bytes_allocator": None, "peak_bytes_allocator": None}

    boundary = model.mb_size * model.seq_len * model.hidden * 4
    doc = {
        "schema": "ppsim.profile", "version": 2, "created": "2026-11-22T10:00:00Z", "device": "cpu",
        "device_name": "test", "torch_version": "test", "host": "test", "world_size": 1, "backend": None,
        "model": model.to_dict(),
        "blocks": {"embed": block(1e-4, 2048, boundary, 64), "layer": block(1e-3, 4096, boundary, 10_000),
                   "head": block(5e-4, 2048, 0, 4_000, 1_000)},
        "layout": ["embed", *(["layer"] * model.layers), "head"],
        "stage_overhead": {op: stat(1e-5).to_dict() for op in ("F", "B", "I", "W", "FB")},
        "runtime": RUNTIME, "num_stages": 0, "stages": [], "p2p": None, "complete": True, "done": [],
        "method": None, "notes": [],
    }
    path.write_text(json.dumps(doc))
    return path


def simulated_makespan(*args: str) -> float:
    result = CliRunner().invoke(app, ["simulate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["makespan"]


@pytest.mark.slow
@pytest.mark.parametrize("split", [None, "1,3"])
def test_run_predicts_exactly_what_simulate_predicts_from_the_profile(tmp_path: Path, split: str | None) -> None:
    profile = write_block_profile(tmp_path / "p.json")
    out = tmp_path / "run.json"
    extra = [] if split is None else ["--split", split]
    code, _, stderr = invoke("-s", "ZBH1", "-r", "2", "-m", "4", "--profile", str(profile), "-o", str(out), *extra,
                             *FAST)
    assert code == 0, stderr
    data = check_run_json(out, "ZBH1", 2, 4)
    assert data["predicted_step_s"] == pytest.approx(
        simulated_makespan("-s", "ZBH1", "-r", "2", "-m", "4", "--profile", str(profile), *extra), rel=1e-12)
    inputs = data["prediction_inputs"]
    assert inputs["fitted_on_this_run"] is False and inputs["compute_scale"] == 1.5  # the profile's 2-rank entry
    assert inputs["dispatch_s"] == 0.001 and inputs["recv_posting"] == "consumer"
    assert data["explained_model"]["post_hoc"] is True  # the run-fitted number lives apart
    for m in data["memory"]:  # measured next to the prediction
        assert m["peak_activation_bytes_measured"] > 0 and m["param_bytes_measured"] > 0
        assert m["peak_activation_bytes_predicted"] is not None


def _fake_measurement(schedule, result, factor: float):  # type: ignore[no-untyped-def]
    rows = tuple(
        _timing(r, pos, str(a), result.starts[r][pos] * factor, result.ends[r][pos] * factor)
        for r, row in enumerate(schedule.actions) for pos, a in enumerate(row)
    )
    return _measurement((rows,), (rows, rows, rows), probes=(rows,))


@pytest.mark.parametrize("factor", [0.5, 3.0])
def test_the_prediction_uses_nothing_measured_in_the_run(tmp_path: Path, factor: float) -> None:
    """Whatever the run measures (here: made-up timings, twice or half as fast as predicted), predicted_step_s is
    the profile's simulation; only the post-hoc number follows the run."""
    from ppsim.calibrate.execute import run
    from ppsim.costs import load_costs
    from ppsim.simulator import simulate


    profile = write_block_profile(tmp_path / "p.json")
    schedule = get_schedule("1F1B", 2, 4)
    costs = load_costs(profile=profile).for_schedule(schedule)
    expected = simulate(schedule, costs)
    report = run.build_report(schedule, _fake_measurement(schedule, expected, factor), costs, expected,
                              time_scale=1.0, source=str(profile))
    data = report.to_dict()
    assert data["predicted_step_s"] == expected.makespan
    assert data["measured_step_s"] == pytest.approx(expected.makespan * factor)
    explained = data["explained_step_s"]
    assert (explained < expected.makespan) if factor < 1 else (explained > expected.makespan)  # follows the run
    assert data["prediction_inputs"]["fitted_on_this_run"] is False


# --- refusals and processes ---------------------------------------------------------------------------------------
def test_a_deadlocking_csv_is_refused_before_anything_runs(tmp_path: Path) -> None:
    csv = tmp_path / "dead.csv"
    csv.write_text("0F0,0B0\n1B0,1F0\n")
    code, _, stderr = invoke("-s", str(csv), "--synthetic")
    assert code == 2 and stderr.count("\n") == 1 and "deadlock" in stderr and "Traceback" not in stderr
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-s", "1F1B", "-r", "2", "-m", "1000000000"], "--allow-large"),
        (["-s", "1F1B", "-r", "2", "-m", "4", "--synthetic", "--costs", "F=1e308,B=1e308"], "F=1e308"),
        (["-s", "1F1B", "-r", "2", "-m", "4", "--synthetic", "--costs", "F=1e9", "--time-unit", "1"], "sleep"),
        (["-s", "1F1B", "-r", "500", "-m", "500", "--synthetic"], "--allow-large"),
        (["-s", "1F1B", "-r", "2", "-m", "2", "--timeout", "nan"], "--timeout"),
    ],
)
def test_unbounded_or_absurd_runs_are_refused_with_one_line(args: list[str], expected: str) -> None:
    code, stdout, stderr = invoke(*args)
    assert code == 2, stdout + stderr
    assert stderr.startswith("Error: ") and stderr.count("\n") == 1 and expected in stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_killing_run_leaves_no_process_behind(sig: str, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "ppsim.cli", "run", "-s", "GPipe", "-r", "3", "-m", "2", "--synthetic", "--costs",
         "F=1,B=1", "--time-unit", "1", "--steps", "5", "--timeout", "300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # what SIGKILL leaves (multiprocessing's folder) stays in here
        preexec_fn=default_signals,  # SIGINT as a terminal leaves it (`nohup pytest &` starts with it ignored)
    )
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= descendants(proc.pid)
            ranks = [p for p in alive(seen) if b"ppsim-rank" in _cmdline(p) or _is_python(p)]
            if len(ranks) >= 4:  # the fork server and three ranks
                time.sleep(1.0)
                seen |= descendants(proc.pid)
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, getattr(signal, sig))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until = time.monotonic() + 15
    while alive(seen) and time.monotonic() < wait_until:
        time.sleep(0.2)
    assert len(seen) >= 4 and not alive(seen), f"left behind: {alive(seen)} of {seen}"


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _is_python(pid: int) -> bool:
    return b"python" in _cmdline(pid)


def test_a_cuda_runs_prediction_carries_the_replayed_reserved_peak_and_the_bytes_outside_the_allocator() -> None:
    """What an out-of-memory judges on a GPU, predicted before the run as simulate counts it (the caching allocator
    replayed, the CUDA context and NCCL's buffers beside it); a CPU run has no caching allocator and keeps none."""
    from ppsim.calibrate.execute.run import _predicted_fields, with_reserved_prediction
    from ppsim.calibrate.execute.steps import ExecSpec
    from ppsim.job.degrees import Degrees
    from ppsim.job.memory import BlockShapes, JobShapes, job_memory
    from ppsim.schedules import get_schedule

    blocks = {f"layers.{i}": BlockShapes("layer", (("w", (512, 512)),), saved_bytes=3 << 20) for i in range(4)}
    shapes = JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=1 << 20)
    modules = [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    schedule = get_schedule("1F1B", 2, 4)
    memory = job_memory(shapes, degrees=Degrees(pp=2, dp_shard=2), schedule=schedule, stage_modules=modules,
                        with_events=True)
    spec = ExecSpec(schedule=schedule, model=None, backend="nccl", device="cuda", num_steps=1, num_warmup=0,
                    num_probes=0, seed=0, timeout_s=60.0, dp_shard=2)
    cpu = _predicted_fields(memory, 0)
    assert cpu["predicted_peak_reserved_bytes"] is None and cpu["predicted_outside_allocator_bytes"] is None
    fields = _predicted_fields(with_reserved_prediction(memory, (shapes, modules), schedule, spec), 0)
    assert fields["predicted_peak_reserved_bytes"] >= fields["predicted_peak_allocated_bytes"]
    assert fields["predicted_outside_allocator_bytes"] > 0
