"""A torchtitan run's parts that both executors share: each stage's module names, the job's meshes, a part through
the model's own parallelize function, EP's all-to-alls counted, and the summed numerics reference.

:mod:`~ppsim.calibrate.torchtitan.runner` (one chain, torch's runtime) and :mod:`~ppsim.calibrate.torchtitan.chains`
(two pipelines, ppsim's chain executor) build their runs from these. torch and torchtitan are imported inside
functions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppsim.calibrate.execute.numerics import ReferenceCheck
    from ppsim.calibrate.execute.steps import ExecSpec
    from ppsim.calibrate.models import ModelSource
    from ppsim.ir import Schedule


FSDP_SUM_NOTE = ("torchtitan disables FSDP's gradient division, so the replicas' (same-batch) gradients are summed; "
                 "the check divides them by dp_shard")


def stage_modules_of(source: ModelSource, schedule: Schedule, counts: Sequence[int] | None) -> list[list[str]]:
    """Each stage's module names, by stage index: :func:`module_names_per_stage` of the one chain, or, for a
    schedule with several chains (DualPipe: each the whole model), each stage the modules of its chain position."""
    length = len(schedule.pipelines[0])
    names = module_names_per_stage(source, length, counts)
    if len(schedule.pipelines) == 1:
        return names
    return [names[schedule.position(s)] for s in range(schedule.num_stages)]


def module_names_per_stage(source: ModelSource, num_stages: int,
                           counts: Sequence[int] | None) -> list[list[str]]:
    """torchtitan's ``module_names_per_stage`` for the split the prediction composed (``counts`` layers per stage;
    ``None``: torchtitan's own ``_generate_llm_fqn_per_model_part`` with its default weights)."""
    if counts is None:
        from ppsim.calibrate.torchtitan.split import stage_module_names

        return [list(p) for p in stage_module_names(num_stages, source.num_layers)]
    assert len(counts) == num_stages and sum(counts) == source.num_layers, (counts, source.num_layers)
    names, first = [], 0
    for s, n in enumerate(counts):
        part = [f"layers.{i}" for i in range(first, first + n)]
        first += n
        if s == 0:
            part.insert(0, "tok_embeddings")
        if s == num_stages - 1:
            part += ["norm", "lm_head"]
        names.append(part)
    return names


def parallel_dims_of(parallelism: Any, world: int, device_type: str) -> Any:
    """torchtitan's ``ParallelDims`` of the run (pp x fsdp x tp), its meshes built on ``device_type`` (torchtitan
    picks the device type at import and falls back to ``cuda``, which a CPU-only torch cannot set)."""
    from torchtitan.distributed import parallel_dims

    return build_mesh(parallel_dims.ParallelDims.from_config(parallelism, world), device_type)


def build_mesh(dims: Any, device_type: str) -> Any:
    """``dims`` (torchtitan's ``ParallelDims``) with its meshes built on ``device_type``: torchtitan picks the device
    type at import and falls back to ``cuda``, which a CPU-only torch cannot set (its DTensors would move there)."""
    from torchtitan.distributed import parallel_dims

    chosen = parallel_dims.device_type
    parallel_dims.device_type = device_type
    try:
        dims.build_mesh()
    finally:
        parallel_dims.device_type = chosen
    return dims


def parallelize_part(source: ModelSource, part: Any, dims: Any, parallelism: Any, ac_config: Any = None) -> Any:
    """One model part through its model's own parallelize function (TP plan, then FSDP2's ``fully_shard`` with
    the run's dtype for parameters and reductions, so the numerics check holds), as ``pipeline_llm`` applies it."""
    import tempfile

    from torchtitan.config import CompileConfig, TrainingConfig

    from ppsim.calibrate.models.torchtitan import model_spec

    dtype = source.config.dtype
    training = TrainingConfig(mixed_precision_param=dtype, mixed_precision_reduce=dtype)
    with tempfile.TemporaryDirectory(prefix="ppsim-titan-") as dump:
        part = model_spec(source).parallelize_fn(part, parallel_dims=dims, training=training,
                                                 parallelism=parallelism, compile_config=CompileConfig(),
                                                 ac_config=ac_config, dump_folder=dump)
    if dims.world_mesh.device_type == "cpu":  # gloo has no PREMUL_SUM/AVG: FSDP sums, then divides
        from torch.distributed.fsdp import FSDPModule

        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return part


EP_NOTE = ("EP's all-to-alls: torchtitan's token dispatcher, its count, dispatch and combine exchanges issued and "
           "timed by ppsim (torch's functional all_to_all_single, as torchtitan issues it; "
           "calibrate/torchtitan/ep_exchange.py)")


def pairs_of(spec: ExecSpec, pp_rank: int) -> dict[tuple[int, int], tuple[int, int]]:
    """This rank's overlapped pairs: forward half ``(stage, microbatch)`` -> backward half's."""
    out = {}
    for action in spec.schedule.actions[pp_rank]:
        if action.sub_actions:
            f, b = action.sub_actions
            out[(f.stage, f.microbatch)] = (b.stage, b.microbatch)
    return out


def count_all_to_alls(spec: ExecSpec, pp_rank: int, stages: list[Any], runtime: Any, clock: Any,
                       ep_group: Any) -> Any:
    """EP's all-to-alls issued and timed by ppsim (:mod:`~ppsim.calibrate.torchtitan.ep_exchange`), and with
    ``spec.overlap`` each overlapped pair's halves run at once (:func:`torch_adapter.overlap_pairs`). The counts
    of each step come back with the measurement."""
    from ppsim.calibrate.execute import torch_adapter
    from ppsim.calibrate.execute.overlap import CommStats, ComputeStream
    from ppsim.calibrate.torchtitan import ep_exchange

    stream = ComputeStream()
    stats = CommStats(stream)
    ep_exchange.install(stream=stream, stats=stats, second=ep_exchange.second_groups(ep_group))
    pairs = pairs_of(spec, pp_rank)
    if spec.overlap and pairs:
        # the untimed allocator-level step runs its pairs in turn: its live-bytes dispatch mode is per thread, and
        # a second thread under the same mode is not safe (CPython SystemErrors seen)
        torch_adapter.overlap_pairs(runtime, stages, pairs, stream=stream, stats=stats, stamp=clock.stamp,
                                    outputs=clock.outputs, context=ep_exchange.second_thread,
                                    enabled=lambda: clock.live is None)
    return stats


def layer_ids_of(part: Any) -> tuple[int, ...]:
    layers = getattr(part, "layers", None)
    return tuple(int(k) for k in layers.keys()) if layers is not None else ()


def summed_reference(source: ModelSource, num_microbatches: int, grads: dict[str, Any], *, seed: int,
                     device: Any) -> ReferenceCheck:
    """The unsplit model (same weights, same batch) one microbatch at a time, each microbatch's loss backward
    unscaled: the gradients torchtitan's ``scale_grads=False`` schedule accumulates (their sum over microbatches).
    ``ref_loss`` is the mean microbatch loss. Compares with ``grads`` (reference name -> pipelined gradient)."""
    from ppsim.calibrate.execute.numerics import compare_with_reference

    ref = source.build_full(seed=seed, device=device)
    tokens, targets = source.make_batch(num_microbatches, seed=seed)
    return compare_with_reference(ref, source.loss_fn, tokens.to(device), targets.to(device), num_microbatches,
                                  grads, summed=True)
