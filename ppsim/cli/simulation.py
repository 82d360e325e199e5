"""Simulation commands: `ppsim simulate`, `plot`, `report`. Comparing several schedules is ppsim.compare's job."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import (
    build_inputs,
    check_figure,
    check_outputs_apart,
    console,
    echo_json,
    job_overrides,
    one_schedule,
    recompute_for,
    run_simulation,
    user_errors,
    warn_cap_without_bytes,
    warn_comparison,
)
from ppsim.cli.options import (
    JOB_CONTEXT,
    AllocatorOpt,
    AllowLargeOpt,
    ClusterOpt,
    CostScopeOpt,
    CostsOpt,
    DirectionsOpt,
    JsonOpt,
    LayersPerStageOpt,
    MaybeScheduleOpt,
    MaybeSchedulesOpt,
    MbOpt,
    MemCapOpt,
    ProfileOpt,
    RanksOpt,
    RecomputeOpt,
    SplitOpt,
    TorchtitanConfigOpt,
    VOpt,
    output_file,
)
from ppsim.errors import PPSimError
from ppsim.io import check_writable, fmt_bytes, parse_memory_cap, release_unused, reserve_new

if TYPE_CHECKING:
    from collections.abc import Callable

    from ppsim.cli.common import Inputs
    from ppsim.cli.job_memory import JobShapesOnce
    from ppsim.costs import StageCosts
    from ppsim.io import MemoryCap
    from ppsim.ir import Schedule
    from ppsim.result import SimResult
    from ppsim.step.cluster import Cluster
    from ppsim.step.model import Step


@app.command("simulate", context_settings=JOB_CONTEXT)
@user_errors
def simulate_cmd(
    ctx: typer.Context,
    schedule: MaybeSchedulesOpt = None,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    memory_cap: MemCapOpt = None,
    json_out: JsonOpt = False,
    directions: DirectionsOpt = None,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = None,
    split: SplitOpt = None,
    layers_per_stage: LayersPerStageOpt = None,
    torchtitan_config: TorchtitanConfigOpt = None,
    recompute: RecomputeOpt = None,
    cluster: ClusterOpt = None,
    allocator: AllocatorOpt = "expandable",
) -> None:
    """Discrete-event replay; with -s A,B,C (or -s A -s B) simulates several and ranks them by makespan."""
    from ppsim.cli.job_memory import check_allocator, job_shapes_of, print_memory, with_job, with_memory
    from ppsim.compare import compare

    check_allocator(allocator)
    overrides = job_overrides(ctx, torchtitan_config)
    inputs = build_inputs(schedule, ranks, mb, stages_per_rank, costs=costs, profile=profile, split=split,
                          layers_per_stage=layers_per_stage, torchtitan_config=torchtitan_config,
                          overrides=overrides)
    names, cost_model = inputs.names, inputs.cost_model
    cap = parse_memory_cap(memory_cap)
    if inputs.job is None or inputs.job.stage_modules is None:  # a job's memory comes from its shapes
        warn_cap_without_bytes(cap, cost_model)
    shapes = job_shapes_of(inputs, torchtitan_config, overrides)
    if shapes is None and getattr(ctx.get_parameter_source("allocator"), "name", "DEFAULT") not in (
            "DEFAULT", "DEFAULT_MAP"):
        raise PPSimError(f"--allocator {allocator}: replays a job's tensors, and a schedule alone has none; give "
                         "--torchtitan-config (a job with shapes) or drop --allocator")
    comparison = compare(
        names, builder=lambda name: inputs.schedule(name, directions, allow_large=allow_large),
        costs=cost_model, scope=cost_scope, memory_cap=cap, allow_large=allow_large,
        recompute=recompute_for(recompute), step=step_of(inputs, shapes, cluster_of(cluster)),
    )
    warn_comparison(comparison, several=len(names) > 1)
    results, memory = with_job(list(comparison.results), inputs, shapes, None if cap is None else cap.bytes,
                               allocator=allocator)
    if json_out:
        echo_json(with_memory(results[0].to_dict(), memory) if len(names) == 1 else [r.to_dict() for r in results])
        return
    print_results(results)
    print_memory(memory, memory_cap, None if cap is None else cap.bytes)
    if cap is not None and memory is None:
        typer.echo(f"memory cap: {cap.describe()}")


def cluster_of(text: str | None) -> Cluster | None:
    """``--cluster NAME|FILE`` read (:func:`ppsim.step.cluster.load_cluster`); ``None`` when not given."""
    if text is None:
        return None
    from ppsim.step.cluster import load_cluster

    return load_cluster(text)


def step_of(inputs: Inputs, shapes: JobShapesOnce | None,
            cluster: Cluster | None = None) -> Callable[[Schedule, StageCosts], Step] | None:
    """A config function's job timed by the one step model (:func:`ppsim.step.build.build_step`: FSDP's collectives
    at dp_shard > 1 where a profile or the cluster prices them, EP's all-to-alls at expert_parallel_degree > 1 (the
    stated default without either), the hand-offs on their links), its groups placed on ``cluster``; ``None`` for a
    job without shapes (a schedule alone)."""
    from ppsim.errors import JobMemoryError

    job, prof = inputs.job, inputs.cost_model.profile
    if (shapes is None or job is None or job.stage_modules is None) and cluster is not None:
        typer.echo(f"note: --cluster {cluster.name}: a schedule alone (no --torchtitan-config job) has no parallel "
                   "groups to place, so the cluster is not used (hand-offs cost the costs' comm); give "
                   "--torchtitan-config to place a job's ranks on it", err=True)
    if shapes is None or job is None or job.stage_modules is None:
        return None
    try:
        job_shapes, degrees = shapes.get()
    except JobMemoryError:
        return None  # the memory table says why
    if degrees.dp_shard <= 1 and degrees.ep <= 1 and cluster is None:
        return None
    from ppsim.step.build import StepJob, build_step
    from ppsim.step.pricing import CollectiveCosts

    costs = None if prof is None else CollectiveCosts.from_profile(prof, cluster)
    placement = None
    if cluster is not None:
        from ppsim.step.placement import place

        placement = place(degrees, cluster.gpus_per_node, cluster_name=f"--cluster {cluster.name}",
                          rank_order=cluster.rank_order)
        cluster.nodes_for(degrees.world_size)  # a cluster of fewer nodes than the job needs: one line
    if prof is None:
        costs = None  # unit costs: a price in seconds has no unit to join (FSDP said unpriced; EP's stated ratio)
    step_job = StepJob(shapes=job_shapes, stage_modules=job.stage_modules, degrees=degrees, costs=costs,
                       placement=placement,
                       # `calibrate --ep`: the all-to-alls are in the layers' measured costs
                       ep_in_blocks=prof is not None and prof.expert_parallel_degree == degrees.ep,
                       activation_bytes=job_shapes.boundary_bytes)
    return lambda schedule, stage_costs: build_step(schedule, stage_costs, step_job)


def print_results(results: list[SimResult]) -> None:
    from rich.table import Table

    con = console()
    unit = results[0].unit
    if len(results) > 1:
        table = Table(title=f"ranked by makespan ({unit})")
        for col in ("#", "schedule", "makespan", "bubble", "peak act.", "peak bytes"):
            table.add_column(col, justify="right" if col not in ("schedule",) else "left")
        for i, r in enumerate(results, 1):
            peak_b = [p.peak_memory_bytes for p in r.per_rank if p.peak_memory_bytes is not None]
            table.add_row(
                str(i), r.schedule.name + (f" (recomputing {len(r.recompute)})" if r.recompute else ""),
                f"{r.makespan:.6g}", f"{r.bubble_ratio:.1%}",
                str(max(p.peak_activations for p in r.per_rank)), fmt_bytes(max(peak_b)) if peak_b else "-",
            )
        con.print(table)
    for r in results:
        s = r.schedule
        table = Table(
            title=f"{s.name}: {s.num_ranks} ranks, {s.num_microbatches} microbatches, {s.num_stages} stages — "
            f"makespan {r.makespan:.6g} {unit}, bubble {r.bubble_ratio:.1%}"
            + (f", recomputing {len(r.recompute)} of {s.num_stages * s.num_microbatches} activations"
               if r.recompute else "")
        )
        for col in ("rank", "busy", "idle", "bubble", "peak act.", "peak bytes"):
            table.add_column(col, justify="right")
        for p in r.per_rank:
            peak = fmt_bytes(p.peak_memory_bytes) if p.peak_memory_bytes is not None else "-"
            act = str(p.peak_activations)
            if p.over_memory_cap and p.peak_memory_bytes is None:  # a cap in activations
                act = f"[bold red]{act} > cap[/]"
            elif p.over_memory_cap:
                peak = f"[bold red]{peak} > cap[/]"
            table.add_row(str(p.rank), f"{p.busy:.6g}", f"{p.idle:.6g}", f"{p.bubble_ratio:.1%}", act, peak)
        con.print(table)



@app.command("plot", context_settings=JOB_CONTEXT)
@user_errors
def plot_cmd(
    ctx: typer.Context,
    schedule: MaybeScheduleOpt = None,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", parser=output_file,
                                     help="png/svg/pdf (static) or html (interactive).")
    ] = None,
    dpi: Annotated[
        Optional[int], typer.Option("--dpi", help="Resolution of png output (default 200; svg/pdf: of their raster "
                                    "parts).", min=20, max=1200)
    ] = None,
    memory: Annotated[bool, typer.Option("--memory", help="Add a memory-over-time panel per rank.")] = False,
    comm: Annotated[bool, typer.Option("--comm", help="Draw p2p hand-offs between ranks as arrows.")] = False,
    memory_cap: MemCapOpt = None,
    directions: DirectionsOpt = None,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = None,
    split: SplitOpt = None,
    layers_per_stage: LayersPerStageOpt = None,
    torchtitan_config: TorchtitanConfigOpt = None,
    recompute: RecomputeOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Gantt chart like the DualPipe figure (default file <schedule>_r<R>_m<M>.png); prints its path."""
    from ppsim.viz import PLOT_FORMATS

    if schedule:
        one_schedule(schedule)
    inputs = build_inputs(schedule, ranks, mb, stages_per_rank, costs=costs, profile=profile, split=split,
                          layers_per_stage=layers_per_stage, torchtitan_config=torchtitan_config,
                          overrides=job_overrides(ctx, torchtitan_config))
    sched = inputs.schedule(one_schedule(inputs.names), directions, allow_large=allow_large, figure=True)
    check_figure(sched, allow_large=allow_large)
    default_name = output is None
    if output is None:
        output = Path(f"{sched.name}_r{sched.num_ranks}_m{sched.num_microbatches}.png")
        if output.exists() or output.is_symlink():
            raise PPSimError(default_taken(output))
    if output.suffix.lower() not in PLOT_FORMATS:
        raise PPSimError(
            f"-o {output}: unknown extension {output.suffix or '(none)'!r}; use one of {', '.join(PLOT_FORMATS)}"
        )
    if dpi is not None and output.suffix.lower() in (".html", ".htm"):
        raise PPSimError(f"--dpi {dpi}: an html chart is drawn by the browser at any resolution, so it would be "
                         "ignored; drop --dpi, or write .png")
    check_writable(output, example="out.png")
    check_outputs_apart([("-o", output)], schedules=schedule,
                        inputs=[("--profile", profile), ("--torchtitan-config", torchtitan_config)])
    from ppsim.viz import plot_to_file

    cost_model = inputs.cost_model
    cap = parse_memory_cap(memory_cap)
    if cap is not None and not memory:
        raise PPSimError(f"--memory-cap {memory_cap}: a plot draws the cap on its memory panel, so without --memory "
                         "it would be ignored; add --memory, or use `ppsim simulate` to flag ranks over it")
    warn_cap_without_bytes(cap, cost_model)
    name = one_schedule(inputs.names)
    shapes = None
    if torchtitan_config is not None:  # a job's step holds its collectives, drawn as a lane under each rank's row
        from ppsim.cli.job_memory import job_shapes_of

        shapes = job_shapes_of(inputs, torchtitan_config, job_overrides(ctx, torchtitan_config))
    timed = step_of(inputs, shapes, cluster_of(cluster))
    if timed is None:
        result = run_simulation(sched, cost_model, cost_scope, cap, recompute_for(recompute)(name, sched))
    else:  # the step simulate times (ppsim.compare), so figure and JSON agree
        from ppsim.compare import compare

        by_option = recompute_for(recompute)
        comparison = compare([name], builder=lambda _: sched, costs=cost_model, scope=cost_scope, memory_cap=cap,
                             figure=True, allow_large=allow_large, recompute=lambda _, s: by_option(name, s),
                             step=timed)
        warn_comparison(comparison, several=False)
        result = comparison.results[0]
    if memory or cap is not None:  # a job's figure draws its memory from the same count as simulate's verdict
        from ppsim.cli.job_memory import with_job

        result = with_job([result], inputs, shapes, None if cap is None or cap.bytes is None else cap.bytes)[0][0]
    if default_name:  # a name ppsim chose: created new, never over a file that appeared meanwhile
        reserve_new(output, refusal=default_taken(output))
    try:
        path = plot_to_file(result, output, dpi=200 if dpi is None else dpi, memory=memory, comm=comm)
    finally:
        if default_name:
            release_unused(output)
    typer.echo(str(path))


def default_taken(path: Path) -> str:
    return (f"{path} exists: without -o, plot writes this default name and never replaces a file; pass -o {path} to "
            "replace it, or -o another name")


@app.command("report", context_settings=JOB_CONTEXT)
@user_errors
def report_cmd(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("--output", "-o", parser=output_file,
                                         help="HTML file to write (self-contained, offline).")],
    schedule: MaybeSchedulesOpt = None,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    memory_cap: MemCapOpt = None,
    directions: DirectionsOpt = None,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = None,
    split: SplitOpt = None,
    layers_per_stage: LayersPerStageOpt = None,
    torchtitan_config: TorchtitanConfigOpt = None,
    search: Annotated[
        bool, typer.Option("--search", help="Add the order `ppsim search` finds under --memory-cap (8act or bytes).")
    ] = False,
    search_time: Annotated[
        Optional[float], typer.Option("--search-time", help="Seconds for --search (default 10).")
    ] = None,
    recompute: RecomputeOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """One self-contained HTML page comparing schedules: ranking, Gantts, memory, bubbles."""
    if output.suffix.lower() not in (".html", ".htm"):
        raise PPSimError(f"-o {output}: a report is an HTML page; use a name ending in .html")
    from ppsim.cli.search import check_time_limit

    if search_time is not None:
        check_time_limit(search_time, "--search-time")
        if not search:
            raise PPSimError(f"--search-time {search_time}: applies to --search only; add --search or drop it")
    check_writable(output, example="report.html")
    check_outputs_apart([("-o", output)], schedules=schedule,
                        inputs=[("--profile", profile), ("--torchtitan-config", torchtitan_config)])
    from ppsim.compare import compare
    from ppsim.viz.report import write_report

    overrides = job_overrides(ctx, torchtitan_config)
    inputs = build_inputs(schedule, ranks, mb, stages_per_rank, costs=costs, profile=profile, split=split,
                          layers_per_stage=layers_per_stage, torchtitan_config=torchtitan_config,
                          overrides=overrides)
    names, cost_model = inputs.names, inputs.cost_model
    searched: dict[str, Schedule | PPSimError] = {}
    cap: MemoryCap | None
    if search:
        from ppsim.cli.search import searched_for_report
        from ppsim.search import SEARCH_NAME

        try:
            found, cap = searched_for_report(inputs.ranks, inputs.mb, cost_model, memory_cap, cost_scope,
                                             10.0 if search_time is None else search_time, allow_large=allow_large)
            searched[found.name] = found
        except PPSimError as exc:  # the searched order is skipped with its reason, as a named one is (compare)
            if not names or inputs.ranks is None or inputs.mb is None or memory_cap is None:
                raise
            searched[SEARCH_NAME] = exc
            cap = parse_memory_cap(memory_cap)
    else:
        cap = parse_memory_cap(memory_cap)
    warn_cap_without_bytes(cap, cost_model)

    def builder(name: str) -> Schedule:
        if name in searched:
            found = searched[name]
            if isinstance(found, PPSimError):
                raise found
            return found
        return inputs.schedule(name, directions, allow_large=allow_large, figure=True)

    by_option = recompute_for(recompute)

    def recomputed(name: str, schedule: Schedule) -> AbstractSet[tuple[int, int]]:
        return frozenset() if name in searched else by_option(name, schedule)

    from ppsim.cli.job_memory import job_shapes_of, with_job

    shapes = job_shapes_of(inputs, torchtitan_config, overrides)
    comparison = compare(list(names) + list(searched), builder=builder, costs=cost_model, scope=cost_scope,
                         memory_cap=cap, figure=True, allow_large=allow_large, recompute=recomputed,
                         step=step_of(inputs, shapes, cluster_of(cluster)))  # the step simulate times
    warn_comparison(comparison, several=len(names) > 1)
    from dataclasses import replace

    cap_bytes = None if cap is None else cap.bytes
    job_results, _ = with_job(list(comparison.results), inputs, shapes, cap_bytes)
    comparison = replace(comparison, results=tuple(job_results))  # a job's page draws the verdict's count
    path = write_report(comparison, output, memory_cap_bytes=cap_bytes)
    typer.echo(str(path))


