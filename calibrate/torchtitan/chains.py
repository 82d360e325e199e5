"""`ppsim run` of a torchtitan model under a schedule with two pipelines (DualPipe): torchtitan's split and
parallelize, ppsim's two-chain executor.

torch's runtime numbers the stages as one chain, so it cannot run DualPipe's two model copies fed from both ends
(:func:`ppsim.calibrate.execute.executor.runtime_refusal`). Here each process does what torchtitan's
``pipeline_llm`` does for the parts it holds, and steps them with
:class:`~ppsim.calibrate.execute.dualpipe.ChainRuntime`:

1. the job's ``ParallelDims`` (``pp`` = the schedule's ranks, ``dp_shard``, ``tp``, ``ep`` carved out of them) and
   the whole model, with the EP sharding plan in it at ``ep`` above 1 (:func:`sharded_full_module`, same seed on every
   rank), as the one-chain runner builds them;
2. one part per chain the rank holds, each cut by torchtitan's own ``_split_module`` with the modules of its chain
   position (both copies from the same weights; a chain is the whole model in ``pp`` stages,
   :func:`~ppsim.calibrate.torchtitan.parts.stage_modules_of`), and, with ``dp_shard x tp`` above 1, put through the
   model's own parallelize function (FSDP, TP, EP, activation checkpointing) as the one-chain runner does;
3. the rank's order walked by ``ChainRuntime``: sends and receives tagged by (stage, microbatch, direction) on the
   ``pp`` group, each stage's backward as torch's runtime runs it (under FSDP the gradients accumulate unsharded
   and are reduce-scattered once after the step's backwards: ``torch_adapter.ChainBackward``), EP's all-to-alls
   issued and timed by ppsim (:mod:`~ppsim.calibrate.torchtitan.ep_exchange`), an overlapped pair's halves one after
   the other.

Numerics: ``ChainRuntime`` scales each microbatch's loss by 1/M (the mean over the batch); the gathered gradients
are multiplied back by M, the two copies' gradients of the same layer summed (DeepSeek's DualPipe sums them) and,
under FSDP, divided by ``dp_shard`` (the replicas, fed the same batch, are summed), then compared with the unsplit
model's summed over the microbatches. torch and torchtitan are imported inside functions only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppsim.calibrate.execute.numerics import ReferenceCheck
    from ppsim.calibrate.execute.steps import ExecSpec, Measurement

CHAINS_NOTE = ("two pipelines (model copies fed from both ends) on ppsim's chain executor: torchtitan's split and "
               "parallelize for each part, ppsim's order walked by calibrate/execute/dualpipe.py (torch's runtime "
               "would join the chains into one)")


def _parts(spec: ExecSpec, rank: int, world: int, device: Any) -> tuple[dict[int, Any], int, Any, list[int] | None,
                                                                         Any]:
    """``(parts by stage, pp_rank, pp group, global rank of each pp rank, ep group)`` of this process."""
    import torch.distributed as dist
    from torchtitan.config import ParallelismConfig

    from ppsim.calibrate.torchtitan.checkpointing import ac_config, apply_ac
    from ppsim.calibrate.torchtitan.parts import parallel_dims_of, parallelize_part, stage_modules_of
    from ppsim.calibrate.torchtitan.split import import_torchtitan

    pp = import_torchtitan("ppsim run of two pipelines through torchtitan's split")
    schedule, source = spec.schedule, spec.source
    assert source is not None
    names = stage_modules_of(source, schedule, spec.layer_counts)
    if spec.dp_shard * spec.tp == 1:
        whole = source.build_full(seed=spec.seed, device=device)
        parts = {s: pp._split_module(whole, names[s]) for s in schedule.stages_of(rank)}
        for part in parts.values():
            apply_ac(part, spec.activation_checkpoint)
        return parts, rank, None, None, None
    from torchtitan.distributed import utils as dist_utils

    from ppsim.calibrate.models.torchtitan import sharded_full_module

    parallelism = ParallelismConfig(pipeline_parallel_degree=schedule.num_ranks,
                                    data_parallel_shard_degree=spec.dp_shard, tensor_parallel_degree=spec.tp,
                                    expert_parallel_degree=spec.ep, spmd_backend="partial_dtensor")
    whole = (sharded_full_module(source, parallelism, seed=spec.seed, device=device) if spec.ep > 1
             else source.build_full(seed=spec.seed, device=device))
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # the model's collectives (EP's dispatch) read it
    dims = parallel_dims_of(parallelism, world, device.type)
    mesh = dims.get_mesh("pp")
    pp_rank, group = mesh.get_local_rank(), mesh.get_group()
    parts = {s: parallelize_part(source, pp._split_module(whole, names[s]), dims, parallelism,
                             ac_config(spec.activation_checkpoint))
             for s in schedule.stages_of(pp_rank)}
    ep_group = dims.get_mesh("ep").get_group() if spec.ep > 1 else None
    return parts, pp_rank, group, dist.get_process_group_ranks(group), ep_group


def run_rank(spec: ExecSpec, rank: int, world: int, local_rank: int) -> Measurement | None:
    """One process of a two-pipeline run (CPU ranks, gloo: :func:`ppsim.calibrate.execute.dualpipe.backend_refusal`
    is checked before the ranks start)."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    from ppsim.calibrate.execute.dualpipe import ChainRuntime, copy_name, sum_copies
    from ppsim.calibrate.execute.steps import Clock, RankRun, measure_rank
    from ppsim.calibrate.torchtitan.parts import (
        EP_NOTE,
        FSDP_SUM_NOTE,
        count_all_to_alls,
        layer_ids_of,
        summed_reference,
    )

    schedule, source = spec.schedule, spec.source
    assert source is not None
    device = torch.device("cpu")
    parts, pp_rank, group, peers, ep_group = _parts(spec, rank, world, device)
    clock = Clock(None, False)
    runtime = ChainRuntime(spec, rank=pp_rank, modules=parts, clock=clock, device=device, peers=peers, group=group,
                           loss_fn=source.loss_fn)
    comm_stats = None if ep_group is None else count_all_to_alls(spec, pp_rank, [], runtime, clock, ep_group)
    tokens, targets = source.make_batch(schedule.num_microbatches, seed=spec.seed)
    m = schedule.num_microbatches

    def grad_name(stage: int, name: str) -> str:
        ref = source.reference_name(layer_ids_of(parts[stage]), name.replace(_CHECKPOINT_PREFIX, ""))
        return copy_name(schedule.direction(stage), ref)

    def reference(grads: dict[str, Any]) -> ReferenceCheck:
        factor = m / spec.dp_shard  # the mean loss back to the sum; FSDP's summed replicas back to one
        summed = {k: g * factor for k, g in sum_copies(grads).items()}
        return summed_reference(source, m, summed, seed=spec.seed, device=device)

    per_rank = spec.dp_shard * spec.tp
    run = RankRun(parts=parts, runtime=runtime, clock=clock, tokens=tokens, targets=targets,
                  has_first=any(schedule.prev_stage(s) is None for s in parts),
                  has_last=any(schedule.next_stage(s) is None for s in parts), grad_name=grad_name,
                  pp_rank=pp_rank, primary=rank % per_rank == 0, comm_stats=comm_stats)
    measurement = measure_rank(spec, rank, world, device, run, reference=reference)
    if measurement is None:
        return None
    notes = [CHAINS_NOTE, "numerics: each microbatch's loss scaled by 1/M, the gradients multiplied back by M and "
                          "the two copies' summed, against the unsplit model's summed over the microbatches"]
    if per_rank > 1:
        notes.append(f"each PP rank is dp_shard {spec.dp_shard} x tp {spec.tp} processes, each part parallelized "
                     "by the model's own torchtitan parallelize function; " + FSDP_SUM_NOTE)
    if comm_stats is not None:
        notes.append(EP_NOTE + "; overlapped pairs ran one half after the other")
    return dataclasses.replace(measurement, notes=(*notes, *measurement.notes))
