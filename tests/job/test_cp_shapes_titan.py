"""Context parallelism (CP) as ppsim counts it, against what torchtitan 0.3.0 itself does on a fake process group
(torch's ``"fake"`` backend; the model on the meta device, so nothing is allocated), for cp 2 and 4:

- **parameters**: each block's elements per rank that ppsim counts (``BlockShapes.sharded_numel(degrees.fsdp)``,
  ``degrees.fsdp`` = dp_shard x cp) against the shards torchtitan's own ``parallelize_fn`` (the model's
  ``parallelize_llama`` / ``parallelize_deepseekv3``, with its ``apply_fsdp_to_decoder``) leaves on a rank: at the
  first rank the DTensor's ``to_local()`` numel, and at the first and the last rank the padded shard FSDP2 allocates
  (``FSDPParam._sharded_param_data``, the same on every rank); the mesh each parameter is sharded on must have
  dp_shard x cp ranks. llama3 runs at dp_shard 3 (FSDP 6 and 12: dims that do not divide, so the padding is checked:
  the last rank's ``to_local()`` is smaller than what ppsim counts and FSDP allocates); deepseek_v3 at dp_shard 2
  (its 8 routed experts of hidden 256 cannot be sharded on 12 ranks: FSDP2 refuses uneven sharding on dim 1).
- **per-rank tokens**: what ppsim counts per microbatch on a rank (``tokens = seq_len x mb / cp``: the embedding's
  saved int64 ids, ``tokens x 8``; the logits, ``tokens x vocab x 2``; the stage boundary, ``tokens x dim x 2``)
  against the inputs and labels torchtitan's ``prepare_context_parallel_input`` (the trainer's CP step,
  ``trainer.py``'s ``post_dataloading_process``) hands every rank of the CP group under the default head-tail
  load balancer; the positions it hands the cp ranks must be rank r's chunks r and 2 cp - 1 - r and cover the
  sequence once.

What this does not run, and why (from the installed sources):

- torchtitan 0.3.0's default ``parallelism.spmd_backend`` is ``"spmd_types"``. Under it the model's
  ``parallelize`` leaves the parameters plain tensors with SPMD type annotations
  (``torchtitan/distributed/spmd_types.py``, ``spmd_distribute_tensor``), and ``resolve_fsdp_mesh``
  (``torchtitan/distributed/full_dtensor.py``) passes ``dp_mesh_dims`` to ``fully_shard`` whenever the storage
  mesh has more than one rank; this venv's torch (2.13) ``fully_shard`` then refuses any plain-tensor parameter
  (``_fsdp_param.py`` ``_init_sharding_spec``: "When dp_mesh_dims is provided, all parameters must be DTensors"),
  with or without CP. So the parameters are compared under the two backends whose FSDP runs here: ``full_dtensor``
  (FSDP on ``dp_shard_cp``, flattened from the ``(dp_shard, cp)`` storage mesh: the same shard axes as
  ``spmd_types``) and ``partial_dtensor`` (FSDP on the legacy ``fsdp`` mesh, dp_shard x cp folded). The placement
  (Shard(0) over dp_shard x cp) is the same in all three by ``resolve_fsdp_mesh``'s shard axes.
- The gathered K/V that ppsim counts per layer under CP (``JobShapes.cp_kv_bytes``) is not compared: it lives inside
  the attention's forward (``apply_cp_to_forward``'s ``flex_cp_allgather`` under ``partial_dtensor``, the
  ``local_map`` boundary's all-gather under ``full_dtensor``), which needs real tensors and a forward; this test
  builds the model on the meta device and runs no forward.
- Both debug models use FlexAttention (0.3.0's ``model_registry`` default ``attn_backend="flex"``); torch's SDPA
  ring-attention path (``_enable_context_parallel_dispatcher``, a global dispatcher switch) is not exercised.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytestmark = pytest.mark.torch

MB = 2
"""Sequences per microbatch (ppsim's ``microbatch_size``; torchtitan's input batch)."""


def _ppsim(name: str, dp_shard: int, cp: int) -> tuple[Any, Any]:
    from ppsim.calibrate.torchtitan.config import read_job_settings
    from ppsim.calibrate.torchtitan.shapes import job_shapes

    overrides = ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.data_parallel_shard_degree",
                 str(dp_shard), "--parallelism.context_parallel_degree", str(cp)]
    return job_shapes(name, read_job_settings(name, overrides), microbatch_size=MB)


def _config(name: str, dp_shard: int, cp: int, backend: str) -> Any:
    from ppsim.calibrate.torchtitan.shapes import converters_set_aside, trainer_config

    with converters_set_aside():
        config = trainer_config(name)
    config.parallelism.data_parallel_shard_degree = dp_shard
    config.parallelism.context_parallel_degree = cp
    config.parallelism.spmd_backend = backend
    config.compile.enable = False
    config.model_spec.model.update_from_config(config=config)
    return config


def _block(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _titan_shards(config: Any, *, dp_shard: int, cp: int, backend: str, rank: int) -> dict[str, Any]:
    """Per block, at ``rank`` of dp_shard x cp: the ``to_local()`` elements, the padded shard FSDP2 allocates, the
    global (unsharded) elements, and the FSDP mesh sizes the parameters are sharded on."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torchtitan.distributed.parallel_dims import ParallelDims

    # DTensor's sharding propagation caches output specs by value, and a mesh of an earlier build (same ranks, same
    # names) compares equal: without this, full_dtensor's parameters come back on the earlier build's mesh object
    # and FSDP2 refuses them ("Expected param's DTensor mesh to be the same mesh passed to fully_shard")
    _clear_sharding_prop_cache()
    with torch.device("meta"):
        model = config.model_spec.model.build()
    world = dp_shard * cp
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, ep=1, world_size=world,
                            spmd_backend=backend)
        dims.build_mesh()
        config.model_spec.parallelize_fn(model, parallel_dims=dims, training=config.training,
                                         parallelism=config.parallelism, compile_config=config.compile,
                                         ac_config=None, dump_folder="")
        padded: dict[int, int] = {}
        for module in model.modules():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            for group in (getattr(state, "_fsdp_param_groups", None) or []) if state is not None else []:
                for fp in group.fsdp_params:
                    padded[id(fp.sharded_param)] = fp._sharded_param_data.numel()
        out: dict[str, Any] = {"local": {}, "padded": {}, "global": {}, "mesh": set()}
        for pname, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{pname} is not sharded by torchtitan's FSDP"
            b = _block(pname)
            out["local"][b] = out["local"].get(b, 0) + p.to_local().numel()
            out["padded"][b] = out["padded"].get(b, 0) + padded[id(p)]
            out["global"][b] = out["global"].get(b, 0) + p.numel()
            out["mesh"].add(p.device_mesh.size())
    finally:
        dist.destroy_process_group()
    return out


def _titan_cp_inputs(*, dp_shard: int, cp: int, seq_len: int, rank: int, monkeypatch: pytest.MonkeyPatch
                     ) -> tuple[int, Any, Any, Any]:
    """The cp rank of global ``rank`` and the inputs, labels and positions torchtitan's CP input preparation hands
    it for a microbatch of ``MB`` sequences of ``seq_len`` tokens, as the trainer calls it."""
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input
    from torchtitan.distributed.parallel_dims import ParallelDims

    # _context_parallel_shard sets torch's CP globals (the dispatch mode, load balancing on): restored after the test
    monkeypatch.setattr(cp_attention, "_dispatch_mode", cp_attention._dispatch_mode)
    monkeypatch.setattr(cp_attention._cp_options, "enable_load_balance", cp_attention._cp_options.enable_load_balance)
    world = dp_shard * cp
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, pp=1, ep=1, world_size=world)
        dims.build_mesh()
        cp_mesh = dims.get_mesh("cp")
        inputs = torch.arange(MB * seq_len, dtype=torch.int64).view(MB, seq_len)
        labels = inputs + 1
        positions = torch.arange(seq_len).unsqueeze(0).expand(MB, seq_len)
        inputs, labels, extra = prepare_context_parallel_input(
            inputs, labels, {"positions": positions}, cp_mesh, torch.device("cpu"),
            ParallelismConfig().context_parallel_load_balancer)
        return cp_mesh.get_local_rank(), inputs, labels, extra["positions"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("name", "dp_shard"), [("llama3:llama3_debugmodel", 3),
                                                ("deepseek_v3:deepseek_v3_debugmodel", 2)])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_parameters_and_tokens_per_rank_equal_torchtitans_on_a_fake_process_group(
        monkeypatch: pytest.MonkeyPatch, name: str, dp_shard: int, cp: int) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("torchtitan")
    import torchtitan.distributed.parallel_dims as parallel_dims

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")  # the fake group's meshes on CPU (as the EP test)
    shapes, degrees = _ppsim(name, dp_shard, cp)
    assert (degrees.cp, degrees.dp_shard, degrees.fsdp) == (cp, dp_shard, dp_shard * cp)
    world = dp_shard * cp

    # --- parameters: ppsim's per-rank count against torchtitan's FSDP shards ----------------------------------
    for backend in ("full_dtensor", "partial_dtensor"):
        config = _config(name, dp_shard, cp, backend)
        first = _titan_shards(config, dp_shard=dp_shard, cp=cp, backend=backend, rank=0)
        last = _titan_shards(_config(name, dp_shard, cp, backend), dp_shard=dp_shard, cp=cp, backend=backend,
                             rank=world - 1)
        assert first["mesh"] == last["mesh"] == {degrees.fsdp}, (backend, first["mesh"])
        assert set(first["local"]) == set(shapes.blocks), backend
        unsharded = {k: sum(math.prod(s) for _, s in b.tensors) for k, b in shapes.blocks.items()}
        assert unsharded == first["global"], backend
        counted = {k: b.sharded_numel(degrees.fsdp) for k, b in shapes.blocks.items()}
        assert counted == first["local"], backend  # rank 0 holds FSDP2's full (padded-size) chunk
        assert counted == first["padded"] == last["padded"], backend
        assert all(last["local"][k] <= counted[k] for k in counted), backend

    # --- tokens: ppsim's tokens / cp against what each rank's CP input preparation hands it -------------------
    seq_len = _config(name, dp_shard, cp, "partial_dtensor").training.seq_len
    act_bytes, dim = 2, shapes.dim  # bfloat16 activations (mixed_precision_param)
    vocab = shapes.blocks["lm_head"].tensors[0][1][0]
    seen: dict[int, list[int]] = {}
    for rank in range(world):
        cp_rank, inputs, labels, positions = _titan_cp_inputs(dp_shard=dp_shard, cp=cp, seq_len=seq_len, rank=rank,
                                                              monkeypatch=monkeypatch)
        assert inputs.shape == labels.shape == positions.shape
        local_tokens = inputs.numel()
        assert shapes.blocks["tok_embeddings"].saved_bytes == local_tokens * inputs.element_size(), (rank, cp_rank)
        assert shapes.logits_bytes == labels.numel() * vocab * act_bytes, (rank, cp_rank)
        assert shapes.boundary_bytes == local_tokens * dim * act_bytes, (rank, cp_rank)
        pos = positions[0].tolist()
        seen.setdefault(cp_rank, pos)
        assert seen[cp_rank] == pos  # every dp_shard rank at one cp rank gets the same slice
    chunk = seq_len // (2 * cp)
    for r, pos in seen.items():  # the head-tail balancer: chunks r and 2 cp - 1 - r
        assert pos == list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * cp - 1 - r) * chunk,
                                                                            (2 * cp - r) * chunk))
    assert sorted(p for pos in seen.values() for p in pos) == list(range(seq_len))
