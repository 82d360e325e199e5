"""Published runs at scale, their CHANGES pinned (docs/scale.md; the bench is bench/bench_published.py): the same
layer costs on both sides of each change, so only what ppsim models of scale moves the step.

- torchtitan's Llama 3.1 8B, FSDP on 8 GPUs (one node) -> 128 (16 nodes), local batch 2, seq 8192, selective AC:
  5,762 -> 5,605 tokens/s/GPU, -2.72 % (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``,
  tables 1 and 3). ppsim: FSDP's all-gathers and reduce-scatters priced by the NCCL model on the h100 preset.
- Llama 3 405B, TP 8 x PP 16 x DP 64 (8,192 GPUs, 32 sequences per DP) -> DP 128 (16,384 GPUs, 16 per DP):
  430 -> 400 TFLOP/s/GPU, -6.98 % ("The Llama 3 Herd of Models", table 4). ppsim: Interleaved 1F1B with one layer
  per stage (the paper's layout: its first stage holds the embedding alone), the bubble at half the microbatches
  and FSDP over 64 vs 128 replicas.

Both within 2 points. Data: the derived profiles in tests/data (bench/published_profiles.py's rules, written by
``python bench/bench_published.py --write-test-data``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

DATA = Path(__file__).resolve().parents[1] / "data"
EIGHT_B = DATA / "llama3_8b_from70b_h100_s8192_mb2_sac.profile.json"
EIGHT_B_MEASURED = DATA / "llama3_8b_h100_s8192_mb1-2_sac.profile.json"
"""Llama 3.1 8B's blocks measured on a lent H100 80GB HBM3 (bf16, seq 8192, microbatch 1 and 2, selective AC; the
device's torch 2.11 with SDPA: docs/scale.md "Measured on a lent H100")."""
FOUR05B = DATA / "llama3_405b_h100_s8192_tp8.profile.json"
TORCHTITAN_8B = (5762, 5605)  # tokens/s/GPU, FSDP 8 -> FSDP 128
LLAMA3_405B = (430, 400)  # TFLOP/s/GPU, 8,192 -> 16,384 GPUs


def _makespan(args: list[str], profile: Path) -> float:
    from ppsim.cli import app

    result = CliRunner().invoke(app, ["simulate", *args, "--profile", str(profile), "--cluster", "h100", "--json"])
    assert result.exit_code == 0, result.output
    return float(json.loads(result.stdout)["makespan"])


@pytest.mark.torch
@pytest.mark.parametrize("profile", [EIGHT_B, EIGHT_B_MEASURED], ids=["derived-from-70b", "measured-on-h100"])
def test_llama3_8b_fsdp_8_to_128_gpus_changes_throughput_as_published_within_2_points(profile: Path) -> None:
    pytest.importorskip("torchtitan.models")
    step = {dp: _makespan(["--torchtitan-config", "llama3:llama3_8b", "--parallelism.pipeline_parallel_degree", "1",
                           "--parallelism.data_parallel_shard_degree", str(dp), "--training.local_batch_size", "2"],
                          profile) for dp in (8, 128)}
    predicted = step[8] / step[128] - 1  # tokens/s/GPU: the same tokens per GPU and step on both sides
    published = TORCHTITAN_8B[1] / TORCHTITAN_8B[0] - 1
    assert predicted < 0
    assert abs(predicted - published) < 0.02, (predicted, published)


@pytest.mark.torch
def test_llama3_405b_8192_to_16384_gpus_changes_tflops_as_published_within_2_points() -> None:
    pytest.importorskip("torchtitan.models")
    step = {}
    for dp, batch in ((64, 32), (128, 16)):
        step[dp] = _makespan(
            ["--torchtitan-config", "llama3:llama3_405b", "--parallelism.pipeline_parallel_degree", "16",
             "--parallelism.tensor_parallel_degree", "8", "--parallelism.data_parallel_shard_degree", str(dp),
             "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
             "--parallelism.pipeline_parallel_layers_per_stage", "1", "--training.local_batch_size", str(batch),
             "--parallelism.pipeline_parallel_microbatch_size", "1"], FOUR05B)
    # FLOP/s per GPU: the global batch (16M tokens) over the step and the GPUs (twice as many at DP 128)
    predicted = step[64] / (2 * step[128]) - 1
    published = LLAMA3_405B[1] / LLAMA3_405B[0] - 1
    assert abs(predicted - published) < 0.02, (predicted, published)


@pytest.mark.torch
def test_run_shapes_at_tp_2_are_tp_local() -> None:
    """``run_shapes`` (simulate --profile's and run's shapes) shards the layers by TP: before, the model's sharding
    plan was never set at EP 1, so a TP 8 job's FSDP collectives moved the whole layer (8x)."""
    pytest.importorskip("torchtitan.models")
    from ppsim.calibrate.models import ModelOptions, parse_model_source
    from ppsim.calibrate.torchtitan.shapes import run_shapes

    src = parse_model_source("torchtitan:llama3/debugmodel", ModelOptions(seq_len=32, mb_size=1, dtype="float32"),
                             device="cpu")
    whole, half = (run_shapes(src, tp=tp).blocks["layers.0"].numel for tp in (1, 2))
    assert half < 0.55 * whole
