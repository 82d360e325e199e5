"""Schedule commands: `ppsim list`, `show`, `validate`, `export`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ppsim.cli._app import app
from ppsim.cli.common import (
    build_costs,
    build_schedule,
    check_outputs_apart,
    one_schedule,
    run_simulation,
    user_errors,
)
from ppsim.cli.options import (
    AllowLargeOpt,
    CostScopeOpt,
    CostsOpt,
    DirectionsOpt,
    ExportFormat,
    JsonOpt,
    LayersPerStageOpt,
    MbOpt,
    ProfileOpt,
    RanksOpt,
    ScheduleOpt,
    SplitOpt,
    VOpt,
    output_file,
)
from ppsim.cli.output import print_schedules
from ppsim.errors import PPSimError
from ppsim.io import check_writable


# --- list / show / validate / export ----------------------------------------------------------------------------
@app.command("list")
@user_errors
def list_cmd(
    json_out: JsonOpt = False,
    clusters: Annotated[bool, typer.Option("--clusters", help="List the cluster presets (--cluster) instead.")] = False,
) -> None:
    """Every schedule with its stages per rank, constraints and a one-line description (--clusters: every
    cluster preset with its links, NICs, device and sources)."""
    if clusters:
        from ppsim.cli.collective import print_clusters

        print_clusters(json_out=json_out)
        return
    print_schedules(json_out=json_out)


@app.command("show")
@user_errors
def show_cmd(
    schedule: ScheduleOpt,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    directions: DirectionsOpt = None,
    allow_large: AllowLargeOpt = False,
) -> None:
    """The order as a text grid, one row per rank."""
    from ppsim.formats import to_text_grid
    from ppsim.schedules.loading import InvalidScheduleError, check_schedule, is_schedule_file

    name = one_schedule(schedule)
    sched = build_schedule(name, ranks, mb, stages_per_rank, directions, allow_large=allow_large, check=False)
    if is_schedule_file(name):
        try:  # showing an invalid file helps to fix it: say so, then show it
            check_schedule(sched, path=name, num_pipelines=directions or 1)
        except InvalidScheduleError as exc:
            typer.echo(f"warning: {exc}", err=True)
    typer.echo(
        f"{sched.name}: {sched.num_ranks} ranks, {sched.num_microbatches} microbatches, "
        f"{sched.num_stages} stages ({sched.num_stages_per_rank} per rank)"
    )
    typer.echo(to_text_grid(sched))


@app.command("validate")
@user_errors
def validate_cmd(
    file: Annotated[Path, typer.Argument(help="Schedule CSV in torch's format (compute-only or compute+comms).")],
    mb: MbOpt = None,
    directions: DirectionsOpt = None,
    allow_large: AllowLargeOpt = False,
) -> None:
    """Check a schedule file; exit 0 and `valid`, or exit 1 with one line per problem."""
    from ppsim.formats import ScheduleStructureError
    from ppsim.schedules.loading import load_for_validation
    from ppsim.validate import Problem, validate

    sched = None
    try:
        sf, sched = load_for_validation(
            file, num_microbatches=mb, num_pipelines=directions or 1, allow_large=allow_large
        )
    except ScheduleStructureError as exc:  # placement problems are problems of the file, not of the command line
        problems = [Problem(None, None, None, str(exc))]
    else:
        if sf.dropped_note:
            typer.echo(f"note: {sf.dropped_note}", err=True)
        problems = validate(sched)
    if not problems:
        typer.echo("valid")
        return
    for p in problems:
        typer.echo(str(p))
    if (directions in (None, 1) and any("deadlock" in p.message for p in problems) and sched is not None
            and sched.num_stages == 2 * sched.num_ranks > 2):
        typer.echo("hint: a DualPipe file (two independent pipelines) needs --directions 2", err=True)
    raise typer.Exit(code=1)


@app.command("export")
@user_errors
def export_cmd(
    schedule: ScheduleOpt,
    output: Annotated[Path, typer.Option("--output", "-o", parser=output_file, help="File to write.")],
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    fmt: Annotated[
        ExportFormat, typer.Option("--format", case_sensitive=False, help="csv (torch), json (timed), chrome (trace).")
    ] = ExportFormat.csv,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    directions: DirectionsOpt = None,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = None,
    split: SplitOpt = None,
    layers_per_stage: LayersPerStageOpt = None,
) -> None:
    """Write the schedule as torch's compute-only CSV, timed JSON, or a Chrome/Perfetto trace."""
    sched = build_schedule(one_schedule(schedule), ranks, mb, stages_per_rank, directions, allow_large=allow_large)
    check_writable(output)
    check_outputs_apart([("-o", output)], schedules=schedule, inputs=[("--profile", profile)])
    if fmt is ExportFormat.csv:
        from ppsim.formats import write_csv

        timing = (("--costs", costs), ("--profile", profile), ("--cost-scope", cost_scope and cost_scope.value),
                  ("--split", split), ("--layers-per-stage", layers_per_stage))
        for option, value in timing:
            if value is not None:
                raise PPSimError(f"{option} {value}: a csv export is the order only (no timings), so it would be "
                                 "ignored; drop it, or export --format json or chrome to get timings")
        path = write_csv(sched, output)
    else:
        from ppsim import export
        from ppsim.limits import check_timeline

        check_timeline(sched.name, sched.num_actions, fmt=fmt.value, allow_large=allow_large)
        result = run_simulation(sched, build_costs(costs, profile, split, layers_per_stage), cost_scope)
        writer = export.write_json_timeline if fmt is ExportFormat.json else export.write_chrome_trace
        path = writer(result, output)
    typer.echo(str(path))

