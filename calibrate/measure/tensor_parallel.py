"""Units measured as torchtitan shards them: tensor parallelism of degree ``T`` on ``T`` local ranks.

Each rank (started by :func:`ppsim.calibrate.execute.launch.run_local`, gloo on CPU, nccl on GPUs) cuts the unit
from the model built on the meta device, fills torchtitan's sharding plan with the model config's own
``update_from_config`` (a ``ParallelismConfig`` with ``tensor_parallel_degree = T``), shards it with the model's own
``parallelize`` on a ``ParallelDims`` mesh of ``T`` ranks (what
torchtitan's ``parallelize_llama`` calls), then allocates and initialises only its local shards (random values:
``normal(0, 0.02)`` weights, the model's own buffers). Every rank runs the same actions inside torchtitan's SPMD
context (:func:`spmd_context`: the trainer's ``set_spmd_backend`` and ``get_spmd_context``; outside it the
``spmd_types`` layers run no collective at all), on its sequence shard of the microbatch (sequence parallelism, on by
default: a layer's input and output hold ``seq_len / T`` tokens per rank), so the timings include the layer's TP
collectives; rank 0's are recorded, with the bytes one rank holds.

Layers only: the embedding and the head are measured unsharded (the sharded head's vocab-parallel loss is
torchtitan's trainer's, not the model's), an upper bound the profile's notes state.

torch and torchtitan are imported inside the functions only.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from torch import nn

    from ppsim.calibrate.measure.calibration import CalibrationOptions
    from ppsim.calibrate.models import ModelSource


SPMD_BACKEND = "spmd_types"
"""torchtitan 0.3.0's default ``parallelism.spmd_backend``, which the units are sharded and run with."""


def tp_dims(tp: int) -> Any:
    """torchtitan's ``ParallelDims`` of ``tp`` tensor-parallel ranks (the running process group), its mesh built."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp, spmd_backend=SPMD_BACKEND)
    dims.build_mesh()
    return dims


def spmd_context(dims: Any) -> Any:
    """The context torchtitan's trainer runs a step in (``set_spmd_backend``, then ``get_spmd_context``): without
    it the ``spmd_types`` layers skip their collectives."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(SPMD_BACKEND)
    return dist_utils.get_spmd_context(parallel_dims=dims)()


def sequence_parallel() -> bool:
    """Whether torchtitan shards a TP layer's input and output along the sequence (its default)."""
    from torchtitan.config import ParallelismConfig

    return bool(ParallelismConfig().enable_sequence_parallel)


def tp_stage(source: ModelSource, layer_ids: tuple[int, ...], *, has_embedding: bool, has_head: bool, tp: int,
             seed: int, device: Any) -> nn.Module:
    """The stage holding ``layer_ids`` (and the embedding / head), sharded by torchtitan over the ``tp`` ranks of
    the running process group, only this rank's shards allocated."""
    return tp_stage_and_dims(source, layer_ids, has_embedding=has_embedding, has_head=has_head, tp=tp, seed=seed,
                             device=device)[0]


def tp_stage_and_dims(source: ModelSource, layer_ids: tuple[int, ...], *, has_embedding: bool, has_head: bool,
                      tp: int, seed: int, device: Any) -> tuple[nn.Module, Any]:
    """:func:`tp_stage` and the ``ParallelDims`` it was sharded on (:func:`tp_dims`, built after the model, as
    torchtitan's trainer does), which :func:`spmd_context` runs it in."""
    import types

    import torch
    from torchtitan.config import ParallelismConfig

    from ppsim.calibrate.models import place
    from ppsim.calibrate.models.torchtitan import prepared_config
    from ppsim.calibrate.models.transformer import DTYPES

    config = prepared_config(source)
    parallelism = ParallelismConfig(tensor_parallel_degree=tp)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        full = config.build()
    full = place(full, device="meta", dtype=DTYPES[source.config.dtype])
    stage = copy.copy(full)
    stage._modules = {}
    stage._parameters = dict(full._parameters)
    stage._buffers = dict(full._buffers)
    for name, child in full._modules.items():
        if name != "layers":
            keep = (name == "tok_embeddings" and has_embedding) or (name in ("norm", "lm_head") and has_head)
            stage._modules[name] = child if keep else None
    stage._modules["layers"] = torch.nn.ModuleDict({str(i): full.layers[str(i)] for i in layer_ids})
    dims = tp_dims(tp)
    stage.parallelize(dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        stage.to_empty(device=torch.device(device))
        for module in stage.modules():
            if hasattr(module, "_init_self_parameters"):
                module._init_self_parameters = _plain_init(module)  # torchtitan's init copies unsharded tensors
        with torch.no_grad():
            stage.init_states(buffer_device=torch.device(device))
    return stage, dims


def _plain_init(module: Any) -> Any:
    def init() -> None:
        for p in module._parameters.values():
            if p is not None:
                local = getattr(p, "_local_tensor", p)
                local.fill_(1.0) if "norm" in type(module).__name__.lower() else local.normal_(0.0, 0.02)
    return init


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of this rank's parameter shards."""
    return sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in module.parameters())


def _unit_rank(ctx: Any, opts: CalibrationOptions, unit: Any) -> dict[str, Any] | None:
    """One of the ``T`` ranks measuring ``unit`` (rank 0 returns its profile entry)."""
    import torch
    import torch.distributed as dist

    from ppsim.calibrate.execute.launch import init_world
    from ppsim.calibrate.measure import harness
    from ppsim.calibrate.measure.harness import unit_fields

    torch.set_num_threads(1)
    device: Any = "cpu"
    backend = "gloo"
    if opts.device == "cuda":
        torch.cuda.set_device(ctx.rank)
        device, backend = torch.device("cuda", ctx.rank), "nccl"
    init_world(backend=backend, timeout_s=opts.init_timeout_s, store=ctx.store(opts.init_timeout_s), rank=ctx.rank,
               world_size=ctx.world_size)
    try:
        source = opts.model_source
        module, dims = tp_stage_and_dims(source, unit.layer_ids, has_embedding=unit.has_embedding,
                                         has_head=unit.has_head, tp=ctx.world_size, seed=opts.seed, device=device)
        local = rank_source(source, ctx.world_size)
        bench = harness.StageBench(local.config, opts.num_stages, 1, device=torch.device(device), seed=opts.seed,
                                   unit=unit, source=local, module=module)
        with spmd_context(dims):
            (samples,) = harness.measure_interleaved([bench], warmup=opts.warmup, reps=opts.reps)
            mem = bench.measure_memory()
        dist.barrier()
        if ctx.rank != 0:
            return None
        return unit_fields(opts, unit, samples, mem, param_bytes=local_param_bytes(module))
    finally:
        dist.destroy_process_group()


def rank_source(source: ModelSource, tp: int) -> ModelSource:
    """The model as one TP rank's layers see their microbatch: ``seq_len / tp`` tokens under sequence parallelism
    (the layers gather the rest), else the whole (the bench's input and output gradient; the module is built from
    the model itself)."""
    import dataclasses

    if tp == 1 or not sequence_parallel():
        return source
    return dataclasses.replace(source, config=dataclasses.replace(source.config, seq_len=source.config.seq_len // tp))


def measure_unit_tp(opts: CalibrationOptions, unit: Any) -> dict[str, Any]:
    """``unit`` measured sharded over ``opts.tensor_parallel_degree`` local ranks; rank 0's profile entry."""
    from ppsim.calibrate.execute.launch import run_local

    tp = opts.tensor_parallel_degree
    try:
        return run_local(_unit_rank, (opts, unit), world_size=tp, timeout_s=opts.init_timeout_s + 3600,
                         what=f"tensor-parallel measurement of {unit.name}")
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else type(exc).__name__
        raise PPSimError(f"measuring {unit.name} of {opts.model_source.text} at tensor_parallel_degree {tp} failed "
                         f"({why[:200]}); calibrate at --tp 1, or another flavor") from None
