"""`ppsim run` of a torchtitan model through torchtitan's own pipeline helpers (one rank's side, and its checks).

For a ``--model torchtitan:FAMILY/FLAVOR`` run each rank does what torchtitan's ``pipeline_llm`` does, with ppsim's
order in place of a named schedule:

1. a ``DeviceMesh`` with one ``pp`` dimension over the ranks (gloo on CPU, nccl on CUDA);
2. the whole model (:meth:`ModelSource.build_full`, same seed on every rank) cut by torchtitan's
   ``_pipeline_module_split(model, pp_mesh, pp_schedule, device, module_names_per_stage)``: ``pp_schedule`` is a
   torch schedule name whose rank-to-stage mapping (``_get_pp_rank_to_stage_indices_mapping``: loop or V) equals
   the ppsim schedule's placement (:func:`titan_placement_name`; checked again against the stages it built);
3. the schedule from ``_build_pipeline_schedule(parallelism=ParallelismConfig(pipeline_parallel_schedule_csv=
   <ppsim's compute-only CSV>, ...), local_batch_size=M * mb_size, stages, loss_fn)`` (``num_microbatches=M`` on
   torchtitan releases after 0.3.0: :func:`schedule_arguments`): torch's
   ``_PipelineScheduleRuntime`` loading the CSV, with torchtitan's ``scale_grads=False`` (gradients are the *sum*
   over microbatches) and its ``(loss, extra)`` loss convention.

ppsim's measurement is kept: every computation timed (``torch_adapter.instrument_stage`` on the stages torchtitan
built; the after-forward stamp hooks the schedule instance's ``_maybe_compute_loss``), the receive waits, each
rank's peak saved-activation bytes, gradients gathered under the unsplit model's names. The numerics reference is
the unsplit model on the same batch, one microbatch at a time, its gradients summed over microbatches as
``scale_grads=False`` leaves them; the loss compared is the mean microbatch loss.

Orders torchtitan's runtime cannot run are refused in one line before anything starts (:func:`titan_refusal`):
a placement neither of torchtitan's mappings gives, an order torch's CSV validation rejects. A schedule with two
pipelines (DualPipe) runs on ppsim's chain executor over torchtitan's parts instead (:mod:`.chains`). torch and
torchtitan are imported inside functions only.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from ppsim.calibrate.torchtitan.parts import (
    EP_NOTE,
    FSDP_SUM_NOTE,
    count_all_to_alls,
    layer_ids_of,
    module_names_per_stage,
    pairs_of,
    parallel_dims_of,
    parallelize_part,
    summed_reference,
)
from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.calibrate.execute.numerics import ReferenceCheck
    from ppsim.calibrate.execute.steps import ExecSpec, Measurement, Runner
    from ppsim.calibrate.models import ModelSource
    from ppsim.ir import Schedule

TITAN_NOTE = "stages and schedule built by torchtitan's pipeline helpers"
"""The line the run output and the run JSON's notes carry for a run on this path."""
SUM_NOTE = ("numerics: torchtitan's schedule does not scale gradients (scale_grads=False), so the reference sums "
            "each microbatch's gradients too; the loss is the mean microbatch loss")
_LOOP_NAMES = ("1F1B", "Interleaved1F1B")
_V_NAME = "ZBVZeroBubble"


class TitanRunError(PPSimError):
    """torchtitan's pipeline runtime cannot run this order (or this model)."""


# --- checks in the launching process ---------------------------------------------------------------------------
EXECUTORS = ("auto", "torchtitan", "ppsim")


def choose_runner(executor: str, source: ModelSource, schedule: Schedule, *, synthetic: bool) -> Runner:
    """The runner that executes the run: :class:`TorchtitanRunner` (torchtitan's helpers) for a torchtitan model
    unless ``executor`` is ``ppsim``, else :class:`~ppsim.calibrate.execute.executor.PpsimExecutor`. Refuses (one
    line) an explicit ``torchtitan`` for a model or run it cannot serve, and an order torchtitan's runtime cannot
    run."""
    from ppsim.calibrate.execute.executor import PpsimExecutor

    if executor not in EXECUTORS:
        raise TitanRunError(f"--executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    if executor == "ppsim" or (executor == "auto" and (synthetic or source.scheme != "torchtitan")):
        return PpsimExecutor()
    if synthetic:
        raise TitanRunError("--executor torchtitan with --synthetic: synthetic stages are ppsim's own; drop one")
    if source.scheme != "torchtitan":
        raise TitanRunError(f"--executor torchtitan with --model {source.text}: torchtitan's pipeline helpers "
                            "build torchtitan models (--model torchtitan:FAMILY/FLAVOR); use --executor ppsim")
    refusal = titan_refusal(schedule)
    if refusal is not None:
        raise TitanRunError(refusal)
    return TorchtitanRunner()


def placement(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Stage indices per rank, as the ppsim schedule places them."""
    return tuple(tuple(schedule.stages_of(r)) for r in range(schedule.num_ranks))


def titan_placement_name(schedule: Schedule) -> str:
    """A torch schedule name whose torchtitan rank-to-stage mapping equals ``schedule``'s placement (what
    ``_pipeline_module_split`` is given); :class:`TitanRunError` when neither the loop nor the V mapping does."""
    from ppsim.calibrate.torchtitan.split import rank_stage_indices

    want = placement(schedule)
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    per_rank = {len(stages) for stages in want}
    candidates = [_LOOP_NAMES[0] if num_stages == num_ranks else _LOOP_NAMES[1]]
    if num_stages == 2 * num_ranks:
        candidates.append(_V_NAME)
    if len(per_rank) == 1 and num_stages % num_ranks == 0:
        for name in candidates:
            if rank_stage_indices(name, num_ranks=num_ranks, num_stages=num_stages) == want:
                return name
    shown = "; ".join(f"rank {r}: {','.join(map(str, s))}" for r, s in enumerate(want[:4]))
    more = " ..." if len(want) > 4 else ""
    raise TitanRunError(
        f"{schedule.name}: its placement ({shown}{more}) is neither torchtitan's loop placement (rank r holds "
        f"stages r, r+{num_ranks}, ...) nor its V placement (rank r holds r and {num_stages - 1}-r), so "
        "torchtitan's _pipeline_module_split cannot build it; search with --placement loop or v, or pass "
        "--executor ppsim"
    )


def titan_refusal(schedule: Schedule) -> str | None:
    """Why torchtitan's pipeline path cannot run ``schedule`` (``None`` when it can): torch's runtime limits
    (:func:`~ppsim.calibrate.execute.executor.runtime_refusal`), a placement torchtitan cannot express, an order torch's
    CSV loader refuses (``_validate_schedule``, run here on the same actions)."""
    from ppsim.calibrate.execute.executor import runtime_refusal

    if len(schedule.pipelines) > 1:  # model copies fed from both ends: ppsim's chain executor (chains.py)
        return None
    refusal = runtime_refusal(schedule)
    if refusal is not None:
        return refusal
    try:
        titan_placement_name(schedule)
    except TitanRunError as exc:
        return str(exc)
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    actions = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(schedule.actions)}
    try:
        _validate_schedule(actions, schedule.num_ranks, schedule.num_stages, schedule.num_microbatches)
    except (AssertionError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return (f"{schedule.name} -r {schedule.num_ranks} -m {schedule.num_microbatches}: torch's CSV loader "
                f"(_PipelineScheduleRuntime._load_csv, which torchtitan uses) refuses the order ({first}); "
                "pass --executor ppsim to run it through ppsim's executor")
    return None


# --- the runner (ppsim's launcher and process group, torchtitan's stages and schedule) -----------------------------
class TorchtitanRunner:
    """The :class:`~ppsim.calibrate.execute.steps.Runner` whose ranks build stages and schedule with torchtitan's
    pipeline helpers (:func:`_build`), timed by the shared step loop."""

    name = "torchtitan"

    def launch(self, spec: ExecSpec) -> Measurement:
        from ppsim.calibrate.execute.steps import launch_local

        return launch_local(spec, _body(spec))

    def run_rank(self, spec: ExecSpec, *, rank: int, world: int, store: Any | None = None) -> Measurement | None:
        from ppsim.calibrate.execute.steps import run_in_group

        return run_in_group(spec, rank=rank, world=world, store=store, body=_body(spec))


def _body(spec: ExecSpec) -> Any:
    """One process's run: torch's runtime for one chain, ppsim's chain executor for two (:mod:`.chains`)."""
    if len(spec.schedule.pipelines) == 1:
        return _run_rank
    from ppsim.calibrate.execute.dualpipe import backend_refusal
    from ppsim.calibrate.torchtitan import chains

    refusal = backend_refusal(spec.schedule, spec.backend)
    if refusal is not None:
        raise PPSimError(refusal)
    return chains.run_rank


# --- one rank ---------------------------------------------------------------------------------------------------
def _build(spec: ExecSpec, rank: int, world: int, device: Any, csv_path: str
           ) -> tuple[list[Any], list[Any], Any, int, Any]:
    """torchtitan's stages and schedule for this process: ``(stages, model_parts, schedule, pp_rank, ep_group)``
    (``ep_group``: the EP process group, ``None`` without EP). With FSDP or TP degrees each model part goes through
    the model's own parallelize function, as ``pipeline_llm`` does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import ParallelismConfig

    from ppsim.calibrate.torchtitan.split import import_torchtitan

    pp = import_torchtitan("ppsim run through torchtitan's pipeline helpers")
    schedule, source = spec.schedule, spec.source
    assert source is not None
    name = titan_placement_name(schedule)
    names = module_names_per_stage(source, schedule.num_stages, spec.layer_counts)
    degrees = {} if spec.dp_shard * spec.tp == 1 else {  # a plain PP run keeps the generation's defaults
        "data_parallel_shard_degree": spec.dp_shard, "tensor_parallel_degree": spec.tp,
        "expert_parallel_degree": spec.ep, "spmd_backend": "partial_dtensor"}
    parallelism, count = schedule_arguments(pp, ParallelismConfig, num_microbatches=schedule.num_microbatches,
                                            mb_size=source.config.mb_size,
                                            pipeline_parallel_degree=schedule.num_ranks,
                                            pipeline_parallel_schedule=name, pipeline_parallel_schedule_csv=csv_path,
                                            module_fqns_per_model_part=names, **degrees)
    if spec.ep > 1:  # the routed experts' EP layout is in the model's sharding plan, set from the job's degrees
        from ppsim.calibrate.models.torchtitan import sharded_full_module

        whole = sharded_full_module(source, parallelism, seed=spec.seed, device=device)
    else:
        whole = source.build_full(seed=spec.seed, device=device)
    if spec.dp_shard * spec.tp == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("pp",))
        stages, parts = pp._pipeline_module_split(whole, mesh, name, device, names)
        from ppsim.calibrate.torchtitan.checkpointing import apply_ac

        for part in parts:
            apply_ac(part, spec.activation_checkpoint)
        pp_rank, ep_group = rank, None
    else:
        from torchtitan.distributed import utils as dist_utils

        # as torchtitan's trainer does before it builds: the model's collectives (EP's token dispatch) read it
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        dims = parallel_dims_of(parallelism, world, device.type)
        mesh = dims.get_mesh("pp")
        stages, parts = pp._pipeline_module_split(whole, mesh, name, device, names,
                                                  get_mesh=pp._build_get_mesh_callback(dims))
        from ppsim.calibrate.torchtitan.checkpointing import ac_config

        for i, part in enumerate(parts):
            parts[i] = parallelize_part(source, part, dims, parallelism, ac_config(spec.activation_checkpoint))
            stages[i].submod = parts[i]
        pp_rank = mesh.get_local_rank()
        ep_group = dims.get_mesh("ep").get_group() if spec.ep > 1 else None
    del whole
    built = tuple(st.stage_index for st in stages)
    if built != tuple(schedule.stages_of(pp_rank)):
        raise RuntimeError(f"rank {rank}: torchtitan built stages {built} for {name} but the schedule places "
                           f"{schedule.stages_of(pp_rank)} on PP rank {pp_rank} (ppsim bug)")

    def loss_fn(output: Any, target: Any) -> tuple[Any, None]:  # torchtitan's convention: (loss, extra)
        return source.loss_fn(output, target), None

    logging.disable(logging.WARNING)  # its "fewer microbatches than stages" warning: one run note instead
    try:
        runtime = pp._build_pipeline_schedule(parallelism=parallelism, stages=stages, loss_fn=loss_fn, **count)
    finally:
        logging.disable(logging.NOTSET)
    return stages, parts, runtime, pp_rank, ep_group


def schedule_arguments(pp: Any, config_class: Any, *, num_microbatches: int, mb_size: int,
                       **fields: Any) -> tuple[Any, dict[str, int]]:
    """``(ParallelismConfig, microbatch keyword)`` for ``_build_pipeline_schedule`` in the generation installed:
    0.3.0 takes ``local_batch_size=`` and a ``pipeline_parallel_microbatch_size`` field, later releases
    ``num_microbatches=`` (torchtitan's PR #4121) and a ``num_pp_microbatches`` field."""
    import dataclasses
    import inspect

    names = {f.name for f in dataclasses.fields(config_class)}
    if "pipeline_parallel_microbatch_size" in names:
        fields["pipeline_parallel_microbatch_size"] = mb_size
    if "num_pp_microbatches" in names:
        fields["num_pp_microbatches"] = num_microbatches
    params = inspect.signature(pp._build_pipeline_schedule).parameters
    count = ({"num_microbatches": num_microbatches} if "num_microbatches" in params
             else {"local_batch_size": num_microbatches * mb_size})
    return config_class(**fields), count


def _run_rank(spec: ExecSpec, rank: int, world: int, local_rank: int) -> Measurement | None:
    import torch

    from ppsim.calibrate.execute import torch_adapter
    from ppsim.calibrate.execute.steps import Clock, RankRun, checkpoint_chosen, measure_rank
    from ppsim.formats import write_csv

    schedule, source = spec.schedule, spec.source
    assert source is not None
    cuda = spec.device == "cuda"
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    with tempfile.TemporaryDirectory(prefix="ppsim-titan-") as tmp:
        csv_path = str(write_csv(schedule, os.path.join(tmp, "order.csv")))
        stages, parts, runtime, pp_rank, ep_group = _build(spec, rank, world, device, csv_path)
    clock = Clock(None, cuda)
    for st in stages:
        torch_adapter.instrument_stage(st, begin=clock.begin, finish=clock.finish, posted=clock.post,
                                       outputs=clock.outputs)
    checkpoint_chosen(spec, stages, parts)
    compute_loss = runtime._maybe_compute_loss

    def maybe_compute_loss(*args: Any, **kwargs: Any) -> None:  # the after-forward stamp
        compute_loss(*args, **kwargs)
        clock.finish()

    runtime._maybe_compute_loss = maybe_compute_loss
    comm_stats = None if ep_group is None else count_all_to_alls(spec, pp_rank, stages, runtime, clock, ep_group)
    tokens, targets = source.make_batch(schedule.num_microbatches, seed=spec.seed)
    by_stage = {st.stage_index: part for st, part in zip(stages, parts)}

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    def grad_name(stage: int, name: str) -> str:  # a checkpointed block's wrapper is not in the reference's names
        return source.reference_name(layer_ids_of(by_stage[stage]), name.replace(_CHECKPOINT_PREFIX, ""))

    def reference(pipelined: dict[str, Any]) -> ReferenceCheck:
        if spec.dp_shard > 1:  # torchtitan turns FSDP's division off: the replicas' gradients are summed
            pipelined = {k: g / spec.dp_shard for k, g in pipelined.items()}
        return summed_reference(source, schedule.num_microbatches, pipelined, seed=spec.seed, device=device)

    rank_run = RankRun(parts=by_stage, runtime=runtime, clock=clock, tokens=tokens, targets=targets,
                       has_first=any(st.is_first for st in stages), has_last=any(st.is_last for st in stages),
                       grad_name=grad_name, pp_rank=pp_rank, primary=rank % (spec.dp_shard * spec.tp) == 0,
                       comm_stats=comm_stats)
    measurement = measure_rank(spec, rank, world, device, rank_run, reference=reference)
    if measurement is None:
        return None
    import dataclasses

    notes = [TITAN_NOTE, SUM_NOTE]
    if spec.dp_shard * spec.tp > 1:
        notes.append(f"each PP rank is dp_shard {spec.dp_shard} x tp {spec.tp} processes, parallelized by the "
                     "model's own torchtitan parallelize function; "
                     + (FSDP_SUM_NOTE if spec.dp_shard > 1 else "TP gradients gathered for the check"))
    if comm_stats is not None:
        notes.append(EP_NOTE if not pairs_of(spec, pp_rank) else
                     EP_NOTE + ("; each OVERLAP_F_B pair's backward half ran on a second thread beside its forward "
                                "half, one compute stream between them (ppsim's overlap; torch's runtime runs the "
                                "halves one after the other)" if spec.overlap else
                                "; overlapped pairs ran one half after the other (--no-overlap), as torch's runtime "
                                "runs them"))
    if schedule.num_microbatches < schedule.num_stages:
        notes.append(f"torchtitan warns that {schedule.num_microbatches} microbatches < {schedule.num_stages} "
                     "stages may leave a bubble; it runs the order all the same")
    return dataclasses.replace(measurement, notes=(*notes, *measurement.notes))

