"""Units measured as torchtitan shards them: tensor parallelism of degree ``T`` on ``T`` local ranks, or expert
parallelism of degree ``E`` on ``E`` local ranks (a MoE layer's routed experts split over them, its tokens exchanged
by torchtitan's token dispatcher).

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

**EP** (``--ep E``): the ranks form torchtitan's ``ParallelDims`` with ``dp_shard = ep = E`` (EP carved out of data
parallelism, as a job at that degree has it), the model config takes the EP sharding plan from a
``ParallelismConfig(expert_parallel_degree=E)`` (``update_from_config``: the routed experts' layout), and the
model's own ``parallelize`` places each rank's experts and wires the dispatcher to the ``ep`` mesh, with the SPMD
backend ``ppsim run --ep`` runs (:data:`EP_SPMD_BACKEND`). FSDP is not applied (ppsim's step model adds FSDP's
collectives itself: :mod:`ppsim.step.fsdp`). Each rank feeds its own microbatch (tokens are per rank under data
parallelism: its inputs drawn from ``seed + rank``), so a MoE layer's F and B include its dispatch and combine
all-to-alls at degree ``E``. Only units holding a MoE layer are measured so; the others (a dense layer, the
embedding, the head) see no EP and are measured on one process.

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
"""torchtitan 0.3.0's default ``parallelism.spmd_backend``, which the TP units are sharded and run with."""
EP_SPMD_BACKEND = "partial_dtensor"
"""The SPMD backend of EP units: the one ``ppsim run --ep`` runs PP x EP with (its runner's ``_build``)."""


def spmd_backend(ep: int) -> str:
    return EP_SPMD_BACKEND if ep > 1 else SPMD_BACKEND


def tp_dims(tp: int, ep: int = 1, *, device_type: str | None = None) -> Any:
    """torchtitan's ``ParallelDims`` of ``tp`` tensor-parallel ranks, or of ``ep`` expert-parallel ranks carved out
    of as many data-parallel shards (the running process group), its mesh built (on ``device_type``; ``None``:
    torchtitan's choice)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    from ppsim.calibrate.torchtitan.parts import build_mesh

    dims = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=tp, pp=1, ep=ep, world_size=tp * ep,
                        spmd_backend=spmd_backend(ep))
    if device_type is not None:
        return build_mesh(dims, device_type)
    dims.build_mesh()
    return dims


def spmd_context(dims: Any) -> Any:
    """The context torchtitan's trainer runs a step in (``set_spmd_backend``, then ``get_spmd_context``): without
    it the ``spmd_types`` layers skip their collectives."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(dims.spmd_backend)
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
                      tp: int, seed: int, device: Any, ep: int = 1) -> tuple[nn.Module, Any]:
    """:func:`tp_stage` (or, at ``ep`` above 1, the stage with its routed experts split over ``ep`` ranks) and the
    ``ParallelDims`` it was sharded on (:func:`tp_dims`, built after the model, as torchtitan's trainer does), which
    :func:`spmd_context` runs it in."""
    import torch
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import utils as dist_utils

    from ppsim.calibrate.models import place
    from ppsim.calibrate.models.torchtitan import prepared_config
    from ppsim.calibrate.models.transformer import DTYPES

    if ep > 1:  # the routed experts' EP layout is in the sharding plan; the dispatcher reads the backend
        parallelism = ParallelismConfig(data_parallel_shard_degree=ep, expert_parallel_degree=ep,
                                        spmd_backend=EP_SPMD_BACKEND)
        dist_utils.set_spmd_backend(EP_SPMD_BACKEND)  # as torchtitan's trainer does before it builds
    else:
        parallelism = ParallelismConfig(tensor_parallel_degree=tp)
    config = prepared_config(source, parallelism)
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
    dims = tp_dims(tp, ep, device_type=torch.device(device).type if ep > 1 else None)
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
    """One of the ``T`` (or ``E``) ranks measuring ``unit`` (rank 0 returns its profile entry)."""
    import torch
    import torch.distributed as dist

    from ppsim.calibrate.execute.launch import join_local_world
    from ppsim.calibrate.measure import harness
    from ppsim.calibrate.measure.harness import unit_fields

    device = join_local_world(ctx, backend="nccl" if opts.device == "cuda" else "gloo", timeout_s=opts.init_timeout_s)
    try:
        source = opts.model_source
        ep = opts.expert_parallel_degree
        tp = 1 if ep > 1 else ctx.world_size
        module, dims = tp_stage_and_dims(source, unit.layer_ids, has_embedding=unit.has_embedding,
                                         has_head=unit.has_head, tp=tp, ep=ep, seed=opts.seed, device=device)
        if ep > 1:
            _install_run_exchange()
        local = rank_source(source, tp)
        # EP: each rank its own microbatch (tokens are per rank under data parallelism); TP: the same on every rank
        seed = opts.seed + ctx.rank if ep > 1 else opts.seed
        bench = harness.StageBench(local.config, opts.num_stages, 1, device=torch.device(device), seed=seed,
                                   unit=unit, source=local, module=module)
        with spmd_context(dims):  # under activation checkpointing wrapped after sharding, as torchtitan's parallelize
            (samples,), (mem,) = harness.measure_benches([bench], warmup=opts.warmup, reps=opts.reps,
                                                         activation_checkpoint=opts.activation_checkpoint)
        dist.barrier()
        if ctx.rank != 0:
            return None
        return unit_fields(opts, unit, samples, mem, param_bytes=local_param_bytes(module))
    finally:
        dist.destroy_process_group()


def _install_run_exchange() -> None:
    """The dispatcher's exchanges as ``ppsim run --ep`` issues them (:mod:`ppsim.calibrate.torchtitan.ep_exchange`),
    so that a unit's F and B time the all-to-alls the run will time, under the same checkpoint policy."""
    from ppsim.calibrate.execute.overlap import CommStats, ComputeStream
    from ppsim.calibrate.torchtitan import ep_exchange

    stream = ComputeStream()
    ep_exchange.install(stream=stream, stats=CommStats(stream), second={})


def rank_source(source: ModelSource, tp: int) -> ModelSource:
    """The model as one TP rank's layers see their microbatch: ``seq_len / tp`` tokens under sequence parallelism
    (the layers gather the rest), else the whole (the bench's input and output gradient; the module is built from
    the model itself)."""
    import dataclasses

    if tp == 1 or not sequence_parallel():
        return source
    return dataclasses.replace(source, config=dataclasses.replace(source.config, seq_len=source.config.seq_len // tp))


def measure_unit_tp(opts: CalibrationOptions, unit: Any) -> dict[str, Any]:
    """``unit`` measured sharded over ``opts.tensor_parallel_degree`` local ranks (or, with
    ``opts.expert_parallel_degree`` above 1, its experts over that many); rank 0's profile entry."""
    from ppsim.calibrate.execute.launch import run_local

    ep = opts.expert_parallel_degree
    ranks, name, option = ((ep, "expert_parallel_degree", "--ep") if ep > 1 else
                           (opts.tensor_parallel_degree, "tensor_parallel_degree", "--tp"))
    what = "expert-parallel" if ep > 1 else "tensor-parallel"
    try:
        return run_local(_unit_rank, (opts, unit), world_size=ranks, timeout_s=opts.init_timeout_s + 3600,
                         what=f"{what} measurement of {unit.name}")
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else type(exc).__name__
        raise PPSimError(f"measuring {unit.name} of {opts.model_source.text} at {name} {ranks} failed "
                         f"({why[:200]}); calibrate at {option} 1, or another flavor") from None
