"""Context parallelism counted: memory (activations at tokens / cp, parameters sharded on dp_shard x cp, the
gathered K/V), the step's CP pass (K/V all-gathers in F, their gradients' reduce-scatters in B), torchtitan's
refusals, and CP in the plan's space; no torch."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from job.test_plan import _request, _settings

from ppsim.compare import build
from ppsim.errors import DegreesError, PPSimError
from ppsim.job.degrees import Degrees, check_degrees
from ppsim.job.memory import BlockShapes, JobShapes, job_memory
from ppsim.job.settings import JobSettings
from ppsim.plan import candidates, cp_options, global_batch, stage_modules


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def _shapes(*, cp_kv: int = 0, ac: str = "none") -> JobShapes:
    layer = BlockShapes("layer", (("w", (64, 32)),), saved_bytes=1000)
    blocks = {f"layers.{i}": layer for i in range(4)}
    blocks["tok_embeddings"] = BlockShapes("embedding", (("w", (100, 32)),), saved_bytes=8)
    blocks["norm"] = BlockShapes("head", (("w", (32,)),), saved_bytes=0)
    blocks["lm_head"] = BlockShapes("head", (("w", (100, 32)),), saved_bytes=100)
    return JobShapes(source="toy", blocks=blocks, tp=1, boundary_bytes=64, cp_kv_bytes=cp_kv,
                     activation_checkpoint=ac)


def _modules(stages: int) -> Any:
    from ppsim.split import SplitSpec, resolve_split

    return stage_modules(4, resolve_split(SplitSpec(), 4, stages, schedule="1F1B"))


# --- refusals -------------------------------------------------------------------------------------------------
def test_a_sequence_the_head_tail_balancer_cannot_cut_into_2_cp_chunks_is_one_line() -> None:
    with pytest.raises(DegreesError, match=r"sequence length 4098 is not divisible by 2 x cp = 8") as info:
        check_degrees(Degrees(pp=2, cp=4, dp_shard=2), num_heads=8, num_kv_heads=8, num_layers=8, seq_len=4098)
    assert "\n" not in str(info.value)
    check_degrees(Degrees(pp=2, cp=4, dp_shard=2), num_heads=8, num_kv_heads=8, num_layers=8, seq_len=4096)


def test_cp_on_cpu_ranks_is_refused_by_run_in_one_line() -> None:
    from ppsim.cli.run import refuse_cp_on_cpu

    with pytest.raises(PPSimError, match="context parallelism on cpu ranks cannot run") as info:
        refuse_cp_on_cpu(["--parallelism.context_parallel_degree", "2"], "cpu")
    assert "\n" not in str(info.value)
    refuse_cp_on_cpu(["--parallelism.context_parallel_degree", "2"], "cuda")
    refuse_cp_on_cpu(["--parallelism.context_parallel_degree", "1"], "cpu")


# --- memory ---------------------------------------------------------------------------------------------------
def test_job_memory_counts_cp_and_shards_the_parameters_on_dp_shard_x_cp() -> None:
    schedule = build("1F1B", 2, 4)[0]
    with_cp = job_memory(_shapes(), degrees=Degrees(pp=2, dp_shard=2, cp=2), schedule=schedule,
                         stage_modules=_modules(2))
    fsdp4 = job_memory(_shapes(), degrees=Degrees(pp=2, dp_shard=4), schedule=schedule, stage_modules=_modules(2))
    assert [m.parts["parameters"] for m in with_cp] == [m.parts["parameters"] for m in fsdp4]
    assert [m.parts["optimizer"] for m in with_cp] == [m.parts["optimizer"] for m in fsdp4]


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_the_gathered_kv_is_saved_without_checkpointing_and_regathered_in_the_backward_otherwise(ac: str) -> None:
    from ppsim.calibrate.torchtitan.shapes import _with_cp_kv

    block = BlockShapes("layer", (), saved_bytes=1000, forward_transient_bytes=10, backward_transient_bytes=20)
    assert _with_cp_kv(block, cp=1, ac=ac, kv_bytes=50) is block
    out = _with_cp_kv(block, cp=4, ac=ac, kv_bytes=50)  # 4 ranks' K/V: 200 bytes
    if ac == "none":
        assert (out.saved_bytes, out.forward_transient_bytes, out.backward_transient_bytes) == (1200, 10, 20)
    else:
        assert (out.saved_bytes, out.forward_transient_bytes, out.backward_transient_bytes) == (1000, 210, 220)


def test_kv_width_of_gqa_and_mla() -> None:
    from ppsim.calibrate.torchtitan.shapes import kv_width

    gqa = type("A", (), {"n_heads": 32, "n_kv_heads": 8})()
    assert kv_width(gqa, 4096) == 2 * 8 * 128
    mla = type("M", (), {"n_heads": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128})()
    assert kv_width(mla, 7168) == 128 * 192 + 128 * 128


# --- the step's CP pass ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ac", "gathers_per_backward"), [("none", 0), ("full", 2)])
def test_the_cp_pass_adds_each_layers_kv_gathers_and_gradient_reduce_scatters(ac: str,
                                                                             gathers_per_backward: int) -> None:
    from ppsim.costs import load_costs
    from ppsim.step.build import StepJob, build_step  # noqa: F401
    from ppsim.step.cluster import load_cluster
    from ppsim.step.placement import place
    from ppsim.step.pricing import CollectiveCosts

    schedule = build("1F1B", 2, 4)[0]
    degrees = Degrees(pp=2, cp=2)
    costs = load_costs(costs="F=1,B=2").for_schedule(schedule)
    modules = _modules(2)
    job = StepJob(shapes=_shapes(cp_kv=2**20, ac=ac), stage_modules=modules, degrees=degrees,
                  costs=CollectiveCosts(cluster=load_cluster("h100")), placement=place(degrees, 8),
                  time_scale=1e-3)
    step = build_step(schedule, costs, job)
    layers = sum(1 for stage in modules for m in stage if m.startswith("layers."))  # 4, each stage's once a mb
    def on_cp(kind: str) -> int:  # FSDP gathers too: the dense parameters' mesh is dp_shard x cp = 2
        return sum(p.count for p in step.collectives[kind].placement if p.group == "cp")

    assert on_cp("all_gather") == (2 + gathers_per_backward) * layers * 4
    assert on_cp("reduce_scatter") == 2 * layers * 4
    assert {p.group for p in step.collectives["all_gather"].placement} == {"fsdp", "cp"}
    assert step.collectives["all_gather"].exposed_s == step.collectives["all_gather"].total_s > 0
    assert any("CP (cp 2)" in n for n in step.notes)
    # without CP, nothing added
    plain = build_step(schedule, costs, dataclasses.replace(job, degrees=Degrees(pp=2),
                                                            placement=place(Degrees(pp=2), 8)))
    assert "all_gather" not in plain.collectives


# --- CP in the plan ---------------------------------------------------------------------------------------------
def _long(seq: int) -> JobSettings:
    return dataclasses.replace(_settings(), training={"local_batch_size": 4, "seq_len": seq})


def test_the_plan_varies_cp_only_for_long_sequences_within_a_node_with_tp() -> None:
    short = _request(num_gpus=16, gpus_per_node=8)
    assert cp_options(short, 1) == [1]
    long = _request(num_gpus=16, gpus_per_node=8, settings=_long(32768))
    assert cp_options(long, 1) == [1, 2, 4, 8] and cp_options(long, 2) == [1, 2, 4] and cp_options(long, 8) == [1]
    pinned = _request(num_gpus=16, gpus_per_node=8, pinned={"cp": 2})
    assert cp_options(pinned, 1) == [2]
    space = candidates(long, global_batch(long.settings, 16))
    assert {c.degrees.cp for c in space} == {1, 2, 4, 8}
    for c in space:
        d = c.degrees
        assert d.pp * d.tp * d.cp * d.dp_shard * d.dp_replicate == 16 and d.cp * d.tp <= 8
        launch = " ".join(c.overrides(long.settings))
        assert (f"--parallelism.context_parallel_degree {d.cp}" in launch) == (d.cp > 1)


def test_a_pinned_cp_that_does_not_cut_the_sequence_into_2_cp_chunks_is_refused() -> None:
    from ppsim.plan import PlanError, degree_layouts

    request = _request(num_gpus=16, gpus_per_node=8, pinned={"cp": 4}, settings=_long(32766))
    with pytest.raises(PlanError, match="sequence length 32766 is not divisible by 2 x cp = 8"):
        degree_layouts(request, 16)


def test_cp_has_its_own_nccl_communicator_outside_the_allocator() -> None:
    from ppsim.job.outside import communicators, outside_allocator

    groups = dict(communicators(Degrees(pp=1, dp_shard=2, cp=4)))
    assert groups["cp"] == 4 and groups["fsdp"] == 8 and "tp" not in groups
    with_cp, without = (outside_allocator(Degrees(pp=1, dp_shard=8 // cp, cp=cp)).to_dict() for cp in (4, 1))
    assert "nccl_cp" in with_cp and "nccl_cp" not in without
