"""`ppsim run` of torchtitan models through torchtitan's own pipeline helpers (calibrate/torchtitan/runner.py).

The stages come from torchtitan's ``_pipeline_module_split`` on a ``pp`` DeviceMesh, the schedule from its
``_build_pipeline_schedule`` given ppsim's compute-only CSV; the gradients (summed over microbatches: torchtitan's
``scale_grads=False``) and the loss must match the unsplit model's.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="needs the torchtitan extra")

from typer.testing import CliRunner  # noqa: E402

from ppsim.cli import app  # noqa: E402
from ppsim.schedules import get_schedule, load_schedule  # noqa: E402

pytestmark = pytest.mark.torch

DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA_PROFILE = DATA / "llama3_debugmodel_s32.profile.json"
FAST = ["--steps", "1", "--warmup", "1", "--probes", "0", "--timeout", "300"]


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["run", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def small_source(text: str, **sizes: int):
    from ppsim.calibrate.models import ModelOptions, parse_model_source

    return parse_model_source(text, ModelOptions(seq_len=sizes.pop("seq_len", 32), mb_size=1, **sizes))


# --- placement and split (no processes) -------------------------------------------------------------------------
@pytest.mark.parametrize(("schedule", "num_ranks", "v", "expected"), [
    ("1F1B", 2, None, "1F1B"), ("ZBH1", 4, None, "1F1B"), ("Interleaved1F1B", 2, 2, "Interleaved1F1B"),
    ("Interleaved1F1B", 2, 3, "Interleaved1F1B"), ("ZBVZeroBubble", 2, None, "ZBVZeroBubble"),
    ("DualPipeV", 4, None, "ZBVZeroBubble"),
])
def test_torchtitan_placement_name_maps_stages_to_ranks_as_ppsim_placed_them(
    schedule: str, num_ranks: int, v: int | None, expected: str
) -> None:
    from ppsim.calibrate.torchtitan.runner import placement, titan_placement_name
    from ppsim.calibrate.torchtitan.split import rank_stage_indices

    sched = get_schedule(schedule, num_ranks, 8, v)
    name = titan_placement_name(sched)
    assert name == expected
    assert rank_stage_indices(name, num_ranks=num_ranks, num_stages=sched.num_stages) == placement(sched)


def test_a_placement_torchtitan_cannot_build_is_refused_in_one_line(tmp_path: Path) -> None:
    from ppsim.calibrate.torchtitan.runner import titan_refusal

    csv = tmp_path / "blocked.csv"  # rank 0 holds stages 0,1 and rank 1 holds 2,3: neither loop nor V
    csv.write_text("0F0,1F0,0F1,1F1,1B0,0B0,1B1,0B1\n2F0,3F0,3B0,2B0,2F1,3F1,3B1,2B1\n")
    reason = titan_refusal(load_schedule(str(csv), 2, 2))
    assert reason is not None and "neither torchtitan's loop placement" in reason and "\n" not in reason
    assert titan_refusal(get_schedule("ZBH1", 2, 4)) is None


def test_module_names_follow_the_predicted_split_and_torchtitans_default() -> None:
    from ppsim.calibrate.torchtitan.parts import module_names_per_stage
    from ppsim.calibrate.torchtitan.split import stage_module_names

    source = small_source("torchtitan:llama3/debugmodel")  # 6 layers
    assert module_names_per_stage(source, 2, (2, 4)) == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4", "layers.5", "norm", "lm_head"],
    ]
    assert module_names_per_stage(source, 4, None) == [list(p) for p in stage_module_names(4, 6)]


def test_summed_reference_catches_gradients_scaled_per_microbatch() -> None:
    """torchtitan's schedule leaves gradients summed over microbatches; gradients averaged over them (torch's
    default scale_grads=True) must fail the check, the summed ones pass it exactly."""
    import torch

    from ppsim.calibrate.torchtitan.parts import summed_reference

    source = small_source("torchtitan:llama3/debugmodel", seq_len=8, layers=2)
    m = 2
    model = source.build_full(seed=0)
    tokens, targets = source.make_batch(m, seed=0)
    for tok, tgt in zip(tokens.chunk(m), targets.chunk(m)):
        source.loss_fn(model(tok), tgt).backward()
    summed = {n: p.grad.detach().float() for n, p in model.named_parameters()}
    ok = summed_reference(source, m, summed, seed=0, device="cpu")
    assert ok.grad_max_abs_diff <= 1e-4 * ok.grad_ref_max_abs
    averaged = {n: g / m for n, g in summed.items()}
    bad = summed_reference(source, m, averaged, seed=0, device="cpu")
    assert bad.grad_max_abs_diff > 0.1 * bad.grad_ref_max_abs
    assert ok.num_params_checked == len(summed) and torch.isfinite(torch.tensor(ok.ref_loss))


# --- runs (2 processes each) ------------------------------------------------------------------------------------
def _llama3_run(tmp_path: Path, schedule: str, says: str) -> dict:
    """``ppsim run`` of llama3's debug flavor with the fixture profile on 2 ranks, 4 microbatches: it says ``says``,
    matches the unsplit model and ran the schedule's own order; its JSON."""
    out = tmp_path / "run.json"
    code, stdout, stderr = invoke("--profile", str(LLAMA_PROFILE), "-s", schedule, "-r", "2", "-m", "4",
                                  "-o", str(out), *FAST)
    assert code == 0, stderr
    assert says in stdout
    data = json.loads(out.read_text())
    assert data["grad_ok"] and data["loss_match"] and data["num_params_checked"] > 0
    assert data["grad_max_abs_diff"] <= data["grad_tolerance"]
    order = get_schedule(schedule, 2, 4).actions
    assert [(a["rank"], a["action"]) for a in data["per_action"]] == [
        (r, str(a)) for r, row in enumerate(order) for a in row
    ]
    return data


@pytest.mark.slow
def test_llama3_zbh1_runs_through_torchtitans_helpers_and_matches_the_reference(tmp_path: Path) -> None:
    data = _llama3_run(tmp_path, "ZBH1", "stages and schedule built by torchtitan's pipeline helpers")
    assert data["predicted_step_s"] > 0 and data["measured_step_s"] > 0
    assert all(m["peak_activation_bytes_measured"] > 0 for m in data["memory"])
    assert multiprocessing.active_children() == []


def test_llama3_dualpipe_runs_both_model_copies_on_the_chain_executor_over_torchtitans_parts(tmp_path: Path) -> None:
    """Two pipelines, which torch's runtime would join: ppsim's chain executor walks each rank's order over parts
    torchtitan's ``_split_module`` cut (one per model copy); the copies' summed gradients equal the unsplit model's,
    and each rank's allocator peak is predicted (each stage's modules by its chain position). Not slow:
    the torch-2.15 CI job runs it too (each stage's backward goes through that release's ``PipelineStage``)."""
    data = _llama3_run(tmp_path, "DualPipe", "ppsim's chain executor")
    # a prediction for both ranks, each holding a part of each copy (its accuracy under sharding: test_run_ep.py;
    # this fixture profile's activation bytes are not this run's shapes, for 1F1B alike)
    assert [m["rank"] for m in data["memory"]] == [0, 1]
    assert all(m["peak_allocated_bytes_predicted"] > m["peak_allocated_bytes_measured"] / 2 for m in data["memory"])
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_deepseek_v3_1f1b_runs_through_torchtitans_helpers_and_matches_the_reference() -> None:
    """Dense first layer and MoE layers: every gradient, router and experts included, matches."""
    from ppsim.calibrate.execute.steps import ExecSpec
    from ppsim.calibrate.torchtitan import runner as titan_run

    source = small_source("torchtitan:deepseek_v3/debugmodel")
    schedule = get_schedule("1F1B", 2, 2)
    spec = ExecSpec(schedule=schedule, model=source.config, num_steps=1, num_warmup=0, source=source,
                    timeout_s=300)
    runner = titan_run.choose_runner("auto", source, schedule, synthetic=False)
    assert isinstance(runner, titan_run.TorchtitanRunner)
    measurement = runner.launch(spec)
    assert measurement.grad_ok and measurement.loss_match
    assert titan_run.TITAN_NOTE in measurement.notes
    assert measurement.num_params_checked == sum(1 for _ in source.build_full(seed=0).parameters())
    assert len(measurement.steps) == 1 and len(measurement.steps[0]) == 2 * 2 * 2  # F and B per stage and mb
    assert multiprocessing.active_children() == []


# --- refusals and the executor choice ---------------------------------------------------------------------------
def test_orders_torchtitan_cannot_run_are_refused_before_anything_starts(tmp_path: Path) -> None:
    csv = tmp_path / "blocked.csv"
    csv.write_text("0F0,1F0,0F1,1F1,1B0,0B0,1B1,0B1\n2F0,3F0,3B0,2B0,2F1,3F1,3B1,2B1\n")
    code, _, stderr = invoke("--profile", str(LLAMA_PROFILE), "-s", str(csv), "-r", "2", "-m", "2", *FAST)
    assert code == 2 and "neither torchtitan's loop placement" in stderr and "--executor ppsim" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.json"))


def test_executor_choice() -> None:
    from ppsim.calibrate.execute.executor import PpsimExecutor
    from ppsim.calibrate.torchtitan.runner import TitanRunError, TorchtitanRunner, choose_runner

    titan = small_source("torchtitan:llama3/debugmodel")
    builtin = small_source("builtin:tiny")
    schedule = get_schedule("1F1B", 2, 4)
    assert isinstance(choose_runner("auto", titan, schedule, synthetic=False), TorchtitanRunner)
    assert isinstance(choose_runner("ppsim", titan, schedule, synthetic=False), PpsimExecutor)
    assert isinstance(choose_runner("auto", builtin, schedule, synthetic=False), PpsimExecutor)
    assert isinstance(choose_runner("auto", titan, schedule, synthetic=True), PpsimExecutor)
    with pytest.raises(TitanRunError, match="torchtitan models"):
        choose_runner("torchtitan", builtin, schedule, synthetic=False)
    with pytest.raises(TitanRunError, match="--synthetic"):
        choose_runner("torchtitan", titan, schedule, synthetic=True)
    dualpipe = get_schedule("DualPipe", 2, 4)  # two pipelines: ppsim's chain executor over torchtitan's parts
    assert isinstance(choose_runner("torchtitan", titan, dualpipe, synthetic=False), TorchtitanRunner)
    assert isinstance(choose_runner("auto", titan, dualpipe, synthetic=False), TorchtitanRunner)
    assert isinstance(choose_runner("ppsim", titan, dualpipe, synthetic=False), PpsimExecutor)


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_run_through_torchtitans_helpers(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the nccl path of torchtitan's helpers: one rank per GPU)")
    num_ranks = min(2, torch.cuda.device_count())
    from ppsim.calibrate.execute.steps import ExecSpec
    from ppsim.calibrate.models import ModelOptions, parse_model_source
    from ppsim.calibrate.torchtitan import runner as titan_run

    source = parse_model_source("torchtitan:llama3/debugmodel", ModelOptions(seq_len=64, mb_size=1), device="cuda")
    schedule = get_schedule("ZBH1", num_ranks, 4)
    spec = ExecSpec(schedule=schedule, model=source.config, backend="nccl", device="cuda", num_steps=1,
                    num_warmup=1, source=source, timeout_s=300)
    measurement = titan_run.TorchtitanRunner().launch(spec)
    assert measurement.grad_ok and measurement.loss_match
    assert measurement.clock == "cuda_events" and measurement.device == "cuda"


def test_run_resolves_a_torchtitan_model_once_and_chooses_its_runner_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run --model torchtitan:...` resolves the model at the command line and hands the resolved source through
    the calibration, the costs and the runner: one resolution, one runner choice (the calibration and the launch are
    stubbed: what is counted happens before them)."""
    from ppsim.calibrate.measure import calibration
    from ppsim.calibrate.models import torchtitan as titan_source
    from ppsim.calibrate.torchtitan import runner as titan_run
    from ppsim.errors import PPSimError

    resolved: list[str] = []
    chosen: list[object] = []
    resolve, choose = titan_source.resolve, titan_run.choose_runner

    def counting_resolve(rest: str, *args: object, **kwargs: object) -> object:
        resolved.append(rest)
        return resolve(rest, *args, **kwargs)

    def counting_choose(*args: object, **kwargs: object) -> object:
        chosen.append(args[0])
        return choose(*args, **kwargs)

    def stop(self: object, spec: object) -> None:
        raise PPSimError("stopped before launching")

    monkeypatch.setattr(titan_source, "resolve", counting_resolve)
    monkeypatch.setattr(titan_run, "choose_runner", counting_choose)
    monkeypatch.setattr(calibration, "calibrate", lambda opts: None)  # a calibration that writes nothing
    monkeypatch.setattr(titan_run.TorchtitanRunner, "launch", stop)
    code, _, stderr = invoke("--model", "torchtitan:llama3/debugmodel", "--seq-len", "32", "--mb-size", "1",
                             "-s", "1F1B", "-r", "2", "-m", "2", *FAST)
    assert code == 2 and "stopped before launching" in stderr
    assert resolved == ["llama3/debugmodel"]
    assert chosen == ["auto"]
