"""Memory of a MoE job under expert parallelism (EP) and selective activation checkpointing (SAC), as torchtitan
0.3.0 shards and checkpoints it (ppsim.job.memory, ppsim.calibrate.torchtitan.shapes, simulate's wiring)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner, Result

from ppsim.calibrate.torchtitan.shapes import _forward_linears, _layer_block, _Moe
from ppsim.cli import app
from ppsim.errors import JobMemoryError
from ppsim.job.degrees import Degrees, check_degrees
from ppsim.job.memory import BlockShapes

runner = CliRunner()


def _rows(rows: int, *rest: int, degree: int) -> int:
    """FSDP2's padded shard: ceil(rows / degree) rows of the rest."""
    return math.ceil(rows / degree) * math.prod(rest)


# --- EP validity ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("degrees", "experts", "words"), [
    (Degrees(pp=2, dp_shard=4, ep=3), 6, "expert_parallel_degree 3 does not divide dp_shard x cp x tp = 4"),
    (Degrees(pp=2, dp_shard=4, ep=4), 6, "expert_parallel_degree 4 does not divide the model's 6 experts"),
    (Degrees(pp=2, dp_shard=4, ep=2), None, "the model has no experts (a dense model); pass "
                                            "--parallelism.expert_parallel_degree 1"),
])
def test_an_ep_degree_torchtitan_cannot_carve_is_one_line(degrees: Degrees, experts: int | None, words: str) -> None:
    with pytest.raises(JobMemoryError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        check_degrees(degrees, num_heads=8, num_kv_heads=8, num_layers=16, num_experts=experts)
    assert "\n" not in str(info.value)


def test_ep_carved_out_of_dp_shard_cp_tp_is_accepted() -> None:
    check_degrees(Degrees(pp=2, dp_shard=2, cp=2, tp=2, ep=8), num_heads=8, num_kv_heads=8, num_layers=16,
                  num_experts=16)
    assert Degrees(pp=2, dp_shard=2, cp=2, tp=2, ep=8).efsdp == 1
    assert Degrees(pp=2, dp_shard=128, ep=64).efsdp == 2 and Degrees(pp=2, dp_shard=128).efsdp is None
    assert Degrees(pp=2, dp_shard=4, cp=2).fsdp == 8


# --- the sharding rule ------------------------------------------------------------------------------------------
def test_routed_experts_shard_on_efsdp_dim0_or_dim1_where_efsdp_exceeds_the_local_experts() -> None:
    experts = "moe.routed_experts.inner_experts.w1_EFD"
    block = BlockShapes("moe", ((experts, (4, 6, 10)), ("attention.wo.weight", (10, 12))), saved_bytes=0,
                        sparse=frozenset({experts}))
    # dense on 8 (dim 0: ceil(10/8) = 2 rows of 12), experts on efsdp 2 (dim 0: 2 of the 4 local experts)
    assert block.sharded_numel(8, 2) == 2 * 12 + 2 * 6 * 10
    # efsdp 8 > 4 local experts: torchtitan shards dim 1 (ceil(6/8) = 1 row of 10, for each of the 4 experts)
    assert block.sharded_numel(8, 8) == 2 * 12 + 4 * 1 * 10
    # EP 1: the experts on the dense mesh, dim 1 where it exceeds the experts
    assert block.sharded_numel(2) == 5 * 12 + 2 * 6 * 10
    assert block.sharded_numel(8) == 2 * 12 + 4 * 1 * 10


@pytest.mark.torch
@pytest.mark.parametrize(("dp_shard", "ep"), [(4, 2), (16, 2), (4, 4)])
def test_ep_sharded_count_equals_torchtitans_own_fsdp_on_a_fake_process_group(monkeypatch: pytest.MonkeyPatch,
                                                                              dp_shard: int, ep: int) -> None:
    """torchtitan's ``parallelize_deepseekv3`` (its ``apply_fsdp_to_decoder`` with the ``efsdp`` mesh) on a fake
    process group of dp_shard ranks, layer by layer, against ppsim's count: the padded shard FSDP2 holds."""
    pytest.importorskip("torchtitan")
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.calibrate.torchtitan.shapes import converters_set_aside, job_shapes, trainer_config

    name = "deepseek_v3:deepseek_v3_debugmodel"
    overrides = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                 str(dp_shard), "--parallelism.expert_parallel_degree", str(ep)]
    shapes, degrees = job_shapes(name, read_job_settings(name, overrides))
    with converters_set_aside():
        config = trainer_config(name)
    # the functional-collective backend: its FSDP mesh choice is the same (fsdp / efsdp), and it runs on a fake group
    config.parallelism.expert_parallel_degree, config.parallelism.spmd_backend = ep, "partial_dtensor"
    config.compile.enable = False
    config.model_spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    monkeypatch.setattr(parallel_dims, "device_type", "cpu")
    dist.init_process_group("fake", rank=0, world_size=dp_shard)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=1, pp=1, ep=ep, world_size=dp_shard,
                            spmd_backend="partial_dtensor")
        dims.build_mesh()
        parallelize_deepseekv3(model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
                               compile_config=config.compile, ac_config=None, dump_folder="")
        measured = {f"layers.{i}": sum(p._sharded_param_data.numel() for group in
                                       layer._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params)
                    for i, layer in model.layers.items()}
    finally:
        dist.destroy_process_group()
    assert degrees.efsdp == dp_shard // ep
    counted = {k: shapes.blocks[k].sharded_numel(degrees.fsdp, degrees.efsdp) for k in measured}
    assert counted == measured
    assert shapes.blocks["layers.1"].sparse  # the MoE layers' experts are on the sparse mesh


# --- the debug model end to end ---------------------------------------------------------------------------------
def _debug_layer_elements(dp: int, efsdp: int, ep: int, *, moe: bool, unsharded: bool = False) -> int:
    """One deepseek_v3 debugmodel layer's elements per rank, from its flavor (torchtitan/models/deepseek_v3/
    __init__.py `_debugmodel`): dim 256, 16 heads, q_lora_rank 0, kv_lora_rank 512, qk_nope 128, qk_rope 64,
    v_head 128; layer 0 dense (FFN 1024), the others MoE: 8 experts of hidden 256, 2 shared experts (hidden 512),
    router over 8 experts. ``unsharded``: EP-local but not FSDP-sharded (what a stage gathers)."""
    dim, heads, kv_lora, nope, rope, v_hd = 256, 16, 512, 128, 64, 128
    d, e = (1, 1) if unsharded else (dp, efsdp)
    attn = (_rows(heads * (nope + rope), dim, degree=d) + _rows(kv_lora + rope, dim, degree=d)
            + _rows(kv_lora, degree=d) + _rows(heads * (nope + v_hd), kv_lora, degree=d)
            + _rows(dim, heads * v_hd, degree=d) + 2 * _rows(dim, degree=d))
    if not moe:
        return attn + 2 * _rows(1024, dim, degree=d) + _rows(dim, 1024, degree=d)
    return (attn + 3 * _rows(8 // ep, 256, dim, degree=e) + _rows(8, dim, degree=d) + 2 * _rows(512, dim, degree=d)
            + _rows(dim, 512, degree=d))


@pytest.mark.torch
def test_debugmodel_pp2_ep2_dp_shard2_holds_ep_local_experts_on_efsdp_and_dense_on_dp_shard() -> None:
    pytest.importorskip("torchtitan")
    result = runner.invoke(app, ["simulate", "--torchtitan-config", "deepseek_v3:deepseek_v3_debugmodel",
                                 "--parallelism.pipeline_parallel_degree", "2",
                                 "--parallelism.pipeline_parallel_schedule", "1F1B",
                                 "--parallelism.expert_parallel_degree", "2",
                                 "--parallelism.data_parallel_shard_degree", "2", "--memory-cap", "80GiB", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["per_rank"]
    dp, efsdp, ep = 2, 1, 2  # efsdp = dp_shard x cp x tp / ep
    vocab = _rows(2048, 256, degree=dp)  # tok_embeddings and lm_head: vocab 2048 x dim 256
    # torchtitan's split of 6 layers + embedding + head (each weighted as a layer) into 2 stages of 4 units
    dense, moe = (_debug_layer_elements(dp, efsdp, ep, moe=m) for m in (False, True))
    stage0 = vocab + dense + 2 * moe
    stage1 = 3 * moe + _rows(256, degree=dp) + vocab
    assert [r["memory_parts"]["parameters"] for r in rows] == [4 * stage0, 4 * stage1]
    assert [r["memory_parts"]["optimizer"] for r in rows] == [8 * stage0, 8 * stage1]
    # gathered (bf16): the stage's EP-local experts (4 of 8), unsharded; never the 8
    gathered1 = 3 * _debug_layer_elements(dp, efsdp, ep, moe=True, unsharded=True) + 256 + 2048 * 256
    assert rows[1]["memory_held"]["gathered_parameters"] == 2 * gathered1
    # buffers of layers 3-5: each its RoPE cache (seq_len 2048 x rope_dim 64 / 2, complex64) and the router's
    # expert_bias_E and tokens_per_expert_E (float32, one per expert: 8)
    assert rows[1]["memory_held"]["module_buffers"] == 3 * (2048 * 32 * 8 + 2 * 8 * 4)
    assert "not counted" not in result.output and "upper bound" not in result.output


# --- selective activation checkpointing -------------------------------------------------------------------------
def test_forward_order_puts_a_gated_ffns_w2_after_w3() -> None:
    tensors = (("attention.qkv_linear.wqkv.weight", (6, 4)), ("attention.wo.weight", (4, 4)),
               ("feed_forward.w1.weight", (8, 4)), ("feed_forward.w2.weight", (4, 8)),
               ("feed_forward.w3.weight", (8, 4)), ("attention_norm.weight", (4,)))
    assert [n.split(".")[-2] for n, _ in _forward_linears(tensors)] == ["wqkv", "wo", "w1", "w3", "w2"]


def test_selective_ac_saves_the_input_every_second_matmul_attention_and_nothing_else_llama3_8b() -> None:
    """Llama 3 8B's layer (dim 4096, 32 heads of 128, 8 kv heads, FFN 14336; torchtitan's llama3 `8B` flavor) under
    torchtitan's SelectiveAC: the checkpoint's input; matmuls 1, 3, 5 of wqkv, wo, w1, w3, w2 (wqkv, w1, w2); flex
    attention's output (bf16), log-sum-exp and max scores (fp32, per head)."""
    dim, heads, kv, hd, ffn, n = 4096, 32, 8, 128, 14336, 8192
    tensors = (("attention.qkv_linear.wqkv.weight", ((heads + 2 * kv) * hd, dim)),
               ("attention.wo.weight", (dim, heads * hd)), ("feed_forward.w1.weight", (ffn, dim)),
               ("feed_forward.w2.weight", (dim, ffn)), ("feed_forward.w3.weight", (ffn, dim)),
               ("attention_norm.weight", (dim,)), ("ffn_norm.weight", (dim,)))
    block = _layer_block("layer", tensors, tokens=n, dim=dim, tp=1, sp=False, ac="selective", act_bytes=2,
                         heads=heads, attention_stats=2)
    # flex attention's output, log-sum-exp and max scores (float32 per head and token)
    expected = n * (dim + (heads + 2 * kv) * hd + ffn + dim) * 2 + n * heads * hd * 2 + 2 * n * heads * 4
    assert block.saved_bytes == expected
    none = _layer_block("layer", tensors, tokens=n, dim=dim, tp=1, sp=False, ac="none", act_bytes=2, heads=heads)
    full = _layer_block("layer", tensors, tokens=n, dim=dim, tp=1, sp=False, ac="full", act_bytes=2, heads=heads)
    assert full.saved_bytes < block.saved_bytes < none.saved_bytes
    assert block.backward_transient_bytes == full.backward_transient_bytes  # the recompute rebuilds the layer


def _moe_671b_tensors(ep: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A DeepSeek-V3 671B MoE layer's EP-local shapes (torchtitan/models/deepseek_v3/__init__.py `_671b`): dim
    7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, 256 experts of
    hidden 2048, 1 shared expert; registration order."""
    e = "moe.routed_experts.inner_experts."
    return (("attention.wq_a.weight", (1536, 7168)), ("attention.q_norm.weight", (1536,)),
            ("attention.wq_b.weight", (128 * 192, 1536)), ("attention.wkv_a.weight", (576, 7168)),
            ("attention.kv_norm.weight", (512,)), ("attention.wkv_b.weight", (128 * 256, 512)),
            ("attention.wo.weight", (7168, 128 * 128)), ("attention_norm.weight", (7168,)),
            ("ffn_norm.weight", (7168,)), (e + "w1_EFD", (256 // ep, 2048, 7168)),
            (e + "w2_EDF", (256 // ep, 7168, 2048)), (e + "w3_EFD", (256 // ep, 2048, 7168)),
            ("moe.router.gate.weight", (256, 7168)), ("moe.shared_experts.w1.weight", (2048, 7168)),
            ("moe.shared_experts.w2.weight", (7168, 2048)), ("moe.shared_experts.w3.weight", (2048, 7168)))


@pytest.mark.parametrize("functional", [False, True])
def test_selective_ac_of_a_671b_moe_layer_saves_its_policys_outputs(functional: bool) -> None:
    """Matmuls in forward order: wq_a, wq_b, wkv_a, wkv_b, wo, (router gate: forced to recompute, not counted),
    shared w1, w3, w2: the 1st, 3rd, 5th and 7th are saved (wq_a, wkv_a, wo, shared w3); flex attention's output,
    log-sum-exp and max scores; the router's topk outputs (top 8, top 2 of 8 groups, top 4 groups; fp32 value +
    int64 index); the grouped matmuls are recomputed; the EP all-to-alls' outputs only with functional
    collectives."""
    n, dim, k, ep = 4096, 7168, 8, 64
    moe = _Moe(top_k=k, topk_per_token=8 + 2 * 8 + 4, hidden=2048, ep=ep, expert_share=1, router_share=1)
    block = _layer_block("moe", _moe_671b_tensors(ep), tokens=n, dim=dim, tp=1, sp=False, ac="selective",
                         act_bytes=2, heads=128, moe=moe, functional_comm=functional, attention_stats=2)
    expected = (n * dim * 2 + n * (1536 + 576 + 7168 + 2048) * 2 + n * 128 * 128 * 2 + 2 * n * 128 * 4
                + n * (8 + 16 + 4) * 12)
    if functional:
        expected += 2 * n * k * dim * 2  # dispatch's and combine's received tokens
    assert block.saved_bytes == expected
    assert block.forward_transient_bytes >= 2 * n * k * dim * 2  # the all-to-all's send and receive buffers


# --- DeepSeek-V3 671B on PP 16 x EP 64 x FSDP 128 (2048 GPUs) ---------------------------------------------------
ARGS_671B = ["simulate", "--torchtitan-config", "deepseek_v3:deepseek_v3_671b",
             "--parallelism.pipeline_parallel_degree", "16", "--parallelism.expert_parallel_degree", "64",
             "--parallelism.data_parallel_shard_degree", "128", "--parallelism.pipeline_parallel_schedule",
             "DualPipeV", "--training.local_batch_size", "32", "--memory-cap", "80GiB", "--json"]


@pytest.fixture(scope="module")
def run_671b() -> Result:
    pytest.importorskip("torchtitan")
    result = runner.invoke(app, ARGS_671B)
    assert result.exit_code == 0, result.output
    return result


def _hand_count_671b_per_rank() -> list[int]:
    """Each PP rank's fp32 master parameter bytes, by hand from torchtitan's `_671b` flavor
    (torchtitan/models/deepseek_v3/__init__.py): dim 7168, 61 layers of which the first 3 dense (FFN 18432), vocab
    129280, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim
    128; MoE: 256 routed experts of hidden 2048, 1 shared expert (hidden 2048), router gate 256 x 7168. Dense
    weights FSDP-sharded on dp_shard 128 (rows padded up); routed experts EP-local (256 / 64 = 4) and sharded on
    efsdp = 128 / 64 = 2 (dim 0: efsdp <= 4 local experts)."""
    dim, vocab, heads, q_lora, kv_lora, nope, rope, v_hd = 7168, 129280, 128, 1536, 512, 128, 64, 128
    moe_hidden, dense_ffn, experts, dp, ep = 2048, 18432, 256, 128, 64
    efsdp = dp // ep
    attn = (_rows(q_lora, dim, degree=dp) + _rows(q_lora, degree=dp) + _rows(heads * (nope + rope), q_lora, degree=dp)
            + _rows(kv_lora + rope, dim, degree=dp) + _rows(kv_lora, degree=dp)
            + _rows(heads * (nope + v_hd), kv_lora, degree=dp) + _rows(dim, heads * v_hd, degree=dp)
            + 2 * _rows(dim, degree=dp))  # + attention_norm, ffn_norm
    dense = attn + 2 * _rows(dense_ffn, dim, degree=dp) + _rows(dim, dense_ffn, degree=dp)
    moe = (attn + 3 * _rows(experts // ep, moe_hidden, dim, degree=efsdp) + _rows(experts, dim, degree=dp)
           + 2 * _rows(moe_hidden, dim, degree=dp) + _rows(dim, moe_hidden, degree=dp))
    embedding = head = _rows(vocab, dim, degree=dp)
    # torchtitan's split of 61 layers + embedding + head into 32 stages: stages 0-30 two units each (stage 0:
    # tok_embeddings, layers.0; stage s: layers 2s-1, 2s), stage 31 norm + lm_head; DualPipeV puts stages r and
    # 31 - r on rank r
    rank0 = embedding + dense + _rows(dim, degree=dp) + head
    rank1 = 2 * dense + 2 * moe  # layers 1, 2 (dense) and 59, 60
    return [4 * rank0, 4 * rank1] + [4 * 4 * moe] * 14


# one 671B MoE layer's elements as a rank holds them before FSDP: attention (wq_a, q_norm, wq_b, wkv_a, kv_norm,
# wkv_b, wo, two norms; dims as in the hand count), 256 / 64 = 4 routed experts of w1, w2, w3, the router gate, the
# shared expert's w1, w2, w3
_MOE_LAYER_EP_LOCAL = (1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128
                       + 2 * 7168 + 3 * (256 // 64) * 2048 * 7168 + 256 * 7168 + 3 * 2048 * 7168)


@pytest.mark.torch
@pytest.mark.slow
def test_671b_ep_parameter_bytes_per_rank_equal_a_hand_count_from_the_config(run_671b: Result) -> None:
    rows = json.loads(run_671b.stdout)["per_rank"]
    assert [r["memory_parts"]["parameters"] for r in rows] == _hand_count_671b_per_rank()
    assert [r["memory_parts"]["optimizer"] for r in rows] == [2 * b for b in _hand_count_671b_per_rank()]
    assert all(sum(r["memory_parts"].values()) == r["peak_memory_bytes"] for r in rows)
    # ep x efsdp = dp_shard here, so the sharded bytes equal FSDP over all 256 experts; what EP changes is the
    # gathered copy: bf16, unsharded, the rank's 4 experts of each of its 4 MoE layers (not 256)
    assert {r["memory_held"]["gathered_parameters"] for r in rows[2:]} == {2 * 4 * _MOE_LAYER_EP_LOCAL}


@pytest.mark.torch
@pytest.mark.slow
def test_671b_ep_and_selective_ac_are_counted_not_bounded(run_671b: Result) -> None:
    memory_lines = [line for line in run_671b.output.splitlines() if line.startswith("memory:")]
    assert not [line for line in memory_lines if "upper bound" in line or "not counted" in line]
    assert any("'selective': counted as its policy saves" in line for line in memory_lines)
    assert any("efsdp 2" in line for line in memory_lines)
    rows = json.loads(run_671b.stdout)["per_rank"]
    # rank 2's high point (stage 2's F beside stage 29's B) holds the unsharded fp32 accumulation of its 4 MoE
    # layers' gradients, EP-local: attention (as in the hand count, unsharded), 4 of the 256 experts, gate, shared
    assert rows[2]["memory_parts"]["gradients"] == 4 * 4 * _MOE_LAYER_EP_LOCAL
    assert all(r["fits"] for r in rows)


@pytest.mark.torch
def test_an_ep_degree_that_does_not_divide_the_experts_exits_2_even_without_a_cap() -> None:
    pytest.importorskip("torchtitan")
    result = runner.invoke(app, ["simulate", "--torchtitan-config", "deepseek_v3:deepseek_v3_debugmodel",
                                 "--parallelism.pipeline_parallel_degree", "2",
                                 "--parallelism.expert_parallel_degree", "3",
                                 "--parallelism.data_parallel_shard_degree", "2"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert errors == ["Error: expert_parallel_degree 3 does not divide the model's 8 experts; pick a divisor of 8 "
                      "that also divides dp_shard x cp x tp = 2"]


def test_a_forced_recompute_shape_is_neither_saved_nor_counted_in_the_alternation() -> None:
    """With no forced shape the router gate is the 6th matmul (recomputed) and the shared experts' w1, w3, w2 are
    7th (saved), 8th, 9th (saved): one more saved matmul and a different one than with the default."""
    n, dim, ep = 4096, 7168, 64
    moe = _Moe(top_k=8, topk_per_token=28, hidden=2048, ep=ep, expert_share=1, router_share=1)
    tensors = _moe_671b_tensors(ep)
    default = _layer_block("moe", tensors, tokens=n, dim=dim, tp=1, sp=False, ac="selective", act_bytes=2,
                           heads=128, moe=moe).saved_bytes
    unforced = _layer_block("moe", tensors, tokens=n, dim=dim, tp=1, sp=False, ac="selective", act_bytes=2,
                            heads=128, moe=moe, forced_recompute=()).saved_bytes
    # default saves shared w3's output (2048 wide); unforced saves shared w1's and w2's (2048 + 7168 wide)
    assert unforced - default == n * (2048 + 7168 - 2048) * 2


@pytest.mark.torch
def test_flex_attention_keeps_two_float32_statistics_varlen_one() -> None:
    pytest.importorskip("torchtitan")
    from types import SimpleNamespace

    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    from ppsim.calibrate.torchtitan.shapes import _attention_stats

    assert _attention_stats(SimpleNamespace(inner_attention=FlexAttention.Config())) == 2
    assert _attention_stats(SimpleNamespace(inner_attention=VarlenAttention.Config())) == 1
