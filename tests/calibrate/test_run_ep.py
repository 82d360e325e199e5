"""`ppsim run --ep`: a MoE model's routed experts split over EP ranks carved out of each pipeline rank's dp_shard
processes (torchtitan's rule), through torchtitan's own parallelize function and its token dispatcher's all-to-alls
on gloo; numerics against the unsplit model, each rank's allocator peak beside the before-run prediction, and the
all-to-alls in the predicted step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="needs the torchtitan extra")

from typer.testing import CliRunner  # noqa: E402

from ppsim.cli import app  # noqa: E402

pytestmark = pytest.mark.torch

MOE = ["--model", "torchtitan:deepseek_v3/debugmodel", "--seq-len", "32"]
FAST = ["--steps", "1", "--warmup", "1", "--probes", "0", "--timeout", "400"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


@pytest.mark.parametrize(("extra", "says"), [
    (["--model", "torchtitan:llama3/debugmodel", "--dp-shard", "2", "--ep", "2"], "dense model"),
    ([*MOE, "--dp-shard", "2", "--ep", "4"], "--ep 4: torchtitan carves EP out of the dp_shard x tp = 2"),
    ([*MOE, "--dp-shard", "3", "--ep", "3"], "expert_parallel_degree 3 does not divide the model's 8 experts"),
    ([*MOE, "--dp-shard", "2", "--ep", "0"], "must be at least 1"),
    ([*MOE, "--dp-shard", "2", "--ep", "2", "--overlap", "--backend", "nccl"], "--overlap with --backend nccl"),
    ([*MOE, "--dp-shard", "2", "--ep", "2", "-s", "DualPipe", "-m", "4", "--overlap"], "--overlap with DualPipe"),
])
def test_ep_degrees_that_cannot_run_are_one_line_before_anything_starts(extra: list[str], says: str) -> None:
    result = invoke("-s", "1F1B", "-r", "2", "-m", "2", *FAST, *extra)
    assert result.exit_code == 2, result.output
    assert says in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _run_pp2_by_ep2(tmp_path: Path, schedule: str, microbatches: int, *extra: str) -> tuple[dict, str]:
    """One PP 2 x EP 2 run of the debug flavor (calibrated first at EP 2): its JSON, numerics checked, and the
    prediction's EP note."""
    out = tmp_path / "run.json"
    result = invoke("-s", schedule, "-r", "2", "-m", str(microbatches), *MOE, "--dp-shard", "2", "--ep", "2", *FAST,
                    *extra, "-o", str(out))
    assert result.exit_code == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["grad_ok"] and data["loss_match"]
    ep_notes = [n for n in data["prediction_inputs"]["notes"] if n.startswith("EP (ep 2)")]
    assert ep_notes and "all-to-all" in ep_notes[0]
    return data, ep_notes[0]


@pytest.mark.slow
def test_pp2_by_ep2_on_four_ranks_matches_the_unsplit_model_and_its_predicted_peak(tmp_path: Path) -> None:
    """DeepSeek-V3's debug flavor (8 experts, 5 MoE layers) at PP 2 x EP 2 (EP carved out of dp_shard 2): each
    rank holds 4 experts of each MoE layer and exchanges tokens by all-to-all; the gradients equal the unsplit
    model's, and each PP rank's allocator peak is within 10 % of the prediction made before the run."""
    data, _ = _run_pp2_by_ep2(tmp_path, "1F1B", 2)
    for m in data["memory"]:
        measured, predicted = m["peak_allocated_bytes_measured"], m["peak_allocated_bytes_predicted"]
        assert abs(predicted - measured) <= 0.1 * measured, m


@pytest.mark.slow
def test_pp2_by_ep2_dualpipev_overlaps_its_pairs_and_matches_the_unsplit_model(tmp_path: Path) -> None:
    """DeepSeek-V3's debug flavor (8 experts, 5 MoE layers) at PP 2 x EP 2 (EP carved out of dp_shard 2) under
    DualPipeV: each rank holds 4 experts of each MoE layer and exchanges tokens by all-to-all; each overlapped pair
    runs its backward half on a second thread (its all-to-alls on a second group). The gradients equal the unsplit
    model's, and the run counts every all-to-all torchtitan's dispatcher makes (3 a MoE layer's forward, 2 its
    backward) and every pair. (Memory under EP is checked by the 1F1B run above and by bench/bench_ep.py.)"""
    data, ep_note = _run_pp2_by_ep2(tmp_path, "DualPipeV", 4, "--overlap")
    assert "hide one direction under the other" in ep_note
    a2a = data["all_to_all"]
    assert a2a["calls_per_step"] == 5 * 4 * (3 + 2)  # MoE layers x microbatches x (forward + backward exchanges)
    pairs = sum(1 for row in _orders(data) for a in row if a.startswith("("))
    assert a2a["pairs_overlapped_per_step"] + a2a["pairs_in_turn_per_step"] == pairs > 0
    assert a2a["pairs_overlapped_per_step"] > 0
    assert 0 < a2a["measured_exposed_s"] <= a2a["measured_total_s"]
    assert a2a["predicted_exposed_s"] < a2a["predicted_total_s"]  # the pairs hide some in the step model too
    assert "second thread" in " ".join(data["notes"])


@pytest.mark.slow
def test_pp2_by_ep2_dualpipe_runs_both_model_copies_sharded_and_matches_the_unsplit_model(tmp_path: Path) -> None:
    """DualPipe's two pipelines at PP 2 x EP 2 on ppsim's chain executor over torchtitan's parts: each rank holds a
    part of each model copy, FSDP-sharded over its dp_shard 2 peers with 4 experts of each MoE layer; the copies'
    summed gradients equal the unsplit model's, every all-to-all of both copies is counted, and each PP rank's
    allocator peak is within 10 % of the prediction made before the run (each stage's modules by chain position)."""
    data, _ = _run_pp2_by_ep2(tmp_path, "DualPipe", 4)
    assert "ppsim's chain executor" in " ".join(data["notes"])
    assert data["all_to_all"]["calls_per_step"] == 5 * 4 * (3 + 2)  # MoE layers x microbatches x exchanges
    for m in data["memory"]:
        measured, predicted = m["peak_allocated_bytes_measured"], m["peak_allocated_bytes_predicted"]
        assert abs(predicted - measured) <= 0.1 * measured, m


def _orders(data: dict) -> list[list[str]]:
    """Each rank's actions of the run's order (pairs as ``(F;B)``), from ppsim's own schedule of the run."""
    from ppsim.schedules import get_schedule

    schedule = get_schedule(data["schedule"], data["ranks"], data["microbatches"])
    return [[str(a) for a in row] for row in schedule.actions]


@pytest.mark.parametrize(("extra", "says"), [
    ([*MOE, "--dp-shard", "2", "--activation-checkpoint", "some"], "one of none, selective, full"),
    (["--model", "builtin:tiny", "--activation-checkpoint", "selective"], "needs a torchtitan model"),
    ([*MOE, "--activation-checkpoint", "full", "--recompute", "full"], "pick one way to recompute"),
    ([*MOE, "-s", "ZBVZeroBubble", "--activation-checkpoint", "selective"], "split into I and W"),
])
def test_activation_checkpoint_refusals_are_one_line(extra: list[str], says: str) -> None:
    schedule = [] if "-s" in extra else ["-s", "1F1B"]
    result = invoke(*schedule, "-r", "2", "-m", "2", *FAST, *extra)
    assert result.exit_code == 2, result.output
    assert says in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_shapes_under_ep_hold_half_the_experts_and_sac_saves_less_than_none() -> None:
    """The run's memory inputs at EP 2: each MoE layer's routed experts are EP-local (half of the 8), the dense
    weights whole; torchtitan's SAC policy saves no more than no checkpointing and more than full."""
    from ppsim.calibrate.models import ModelOptions, parse_model_source
    from ppsim.calibrate.torchtitan.shapes import run_shapes

    src = parse_model_source("torchtitan:deepseek_v3/debugmodel", ModelOptions(seq_len=32))
    whole = run_shapes(src, fsdp=True, dp_shard=2)
    by_ac = {ac: run_shapes(src, fsdp=True, dp_shard=2, ep=2, ac=ac) for ac in ("none", "selective", "full")}
    split = by_ac["none"]
    experts = {n: s for n, s in split.blocks["layers.1"].tensors if n.startswith("moe.routed_experts.")}
    assert experts and all(s[0] == 4 for s in experts.values())
    dense = [n for n, _ in split.blocks["layers.1"].tensors if not n.startswith("moe.routed_experts.")]
    assert dict(whole.blocks["layers.1"].tensors)[dense[0]] == dict(split.blocks["layers.1"].tensors)[dense[0]]
    assert split.moe_layers == tuple(f"layers.{i}" for i in range(1, 6)) and split.moe_top_k > 0
    saved = {ac: s.blocks["layers.1"].saved_bytes for ac, s in by_ac.items()}
    assert saved["full"] < saved["selective"] <= saved["none"]
