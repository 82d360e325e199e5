"""ppsim's executor: each rank builds its stages of the model (or synthetic stages,
:mod:`ppsim.calibrate.execute.synthetic`), wraps them in torch's ``PipelineStage`` and runs them in
``_PipelineScheduleRuntime`` with the order set directly from ppsim's :class:`~ppsim.ir.Schedule` (the same order
ppsim simulates, so ppsim-only schedules execute too). A schedule with several chains (DualPipe), which torch's
runtime would join into one, runs on :mod:`ppsim.calibrate.execute.dualpipe` instead. Everything inside torch's
pipelining package goes through :mod:`ppsim.calibrate.execute.torch_adapter`; the steps are timed by
:mod:`ppsim.calibrate.execute.steps`.

torch is imported inside functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppsim.calibrate.execute.steps import (
    Clock,
    ExecSpec,
    Measurement,
    RankBody,
    RankRun,
    checkpoint_chosen,
    launch_local,
    measure_rank,
    run_in_group,
)
from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.ir import Schedule


class PpsimExecutor:
    """The :class:`~ppsim.calibrate.execute.steps.Runner` that builds stages and runtime itself (any model, synthetic
    stages, any order torch's runtime can hold)."""

    name = "ppsim"

    def launch(self, spec: ExecSpec) -> Measurement:
        return launch_local(spec, _body(spec))

    def run_rank(self, spec: ExecSpec, *, rank: int, world: int, store: Any | None = None) -> Measurement | None:
        return run_in_group(spec, rank=rank, world=world, store=store, body=_body(spec))


def _body(spec: ExecSpec) -> RankBody:
    """One rank's run: torch's runtime for one chain, :mod:`~ppsim.calibrate.execute.dualpipe` for several."""
    if len(spec.schedule.pipelines) == 1:
        return _run_rank
    from ppsim.calibrate.execute import dualpipe

    refusal = dualpipe.backend_refusal(spec.schedule, spec.backend)
    if refusal is not None:
        raise PPSimError(refusal)
    return dualpipe.run_rank


def schedule_refusal(schedule: Schedule) -> str | None:
    """Why ppsim's executor cannot execute ``schedule`` (``None`` when it can): several chains run on its own path,
    one chain on torch's runtime."""
    if len(schedule.pipelines) > 1:
        return None
    return runtime_refusal(schedule)


def runtime_refusal(schedule: Schedule) -> str | None:
    """Why torch's runtime cannot execute ``schedule`` (``None`` when it can)."""
    if len(schedule.pipelines) > 1:
        return (
            f"{schedule.name} has {len(schedule.pipelines)} independent pipelines (model copies fed from both ends); "
            "torch's runtime cannot execute it (it would chain the two pipelines, sending stage "
            f"{schedule.pipelines[0][-1]}'s output into stage {schedule.pipelines[1][0]}); pass --executor ppsim, "
            "whose executor runs each chain itself"
        )
    chain = schedule.pipelines[0]
    if tuple(chain) != tuple(range(schedule.num_stages)):
        return f"{schedule.name}: torch's runtime needs the stages to form the chain 0..{schedule.num_stages - 1}"
    return None


def _run_rank(spec: ExecSpec, rank: int, world: int, local_rank: int) -> Measurement | None:
    import torch

    from ppsim.calibrate.execute import torch_adapter
    from ppsim.calibrate.execute.numerics import build_modules, reference_name
    from ppsim.calibrate.models.transformer import loss_fn, make_batch

    schedule = spec.schedule
    cuda = spec.device == "cuda"
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    my_stages = schedule.stages_of(rank)
    modules = build_modules(spec.model, schedule.num_stages, my_stages, synthetic=spec.synthetic, seed=spec.seed,
                            device=device, counts=spec.layer_counts, source=spec.source)
    sleep_s = spec.sleep_s[rank] if spec.synthetic and spec.sleep_s is not None else None
    clock = Clock(sleep_s, cuda)
    stages = [torch_adapter.pipeline_stage(modules[s], s, schedule.num_stages, device) for s in my_stages]
    for st in stages:
        torch_adapter.instrument_stage(st, begin=clock.begin, finish=clock.finish, posted=clock.post,
                                       outputs=clock.outputs)
    checkpoint_chosen(spec, stages, [modules[s] for s in my_stages])
    order = {r: [str(a) for a in row] for r, row in enumerate(schedule.actions)}
    runtime = torch_adapter.runtime(stages, num_microbatches=schedule.num_microbatches, loss_fn=loss_fn,
                                    after_forward=clock.finish, order=order)
    tokens, targets = make_batch(spec.model, schedule.num_microbatches, seed=spec.seed)
    parts = {s: modules[s] for s in my_stages}

    def grad_name(stage: int, name: str) -> str:
        return reference_name(spec.model, schedule.num_stages, stage, name, synthetic=spec.synthetic,
                              counts=spec.layer_counts, source=spec.source)

    rank_run = RankRun(parts=parts, runtime=runtime, clock=clock, tokens=tokens, targets=targets,
                       has_first=0 in my_stages, has_last=schedule.num_stages - 1 in my_stages, grad_name=grad_name)
    return measure_rank(spec, rank, world, device, rank_run)
