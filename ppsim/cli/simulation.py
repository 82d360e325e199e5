"""Simulation commands: `ppsim simulate`, `plot`, `report`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import (
    build_costs,
    build_schedule,
    check_figure,
    console,
    echo_json,
    run_simulation,
    split_names,
    user_errors,
    warn_cap_without_bytes,
    warn_if_not_comparable,
)
from ppsim.cli.options import (
    AllowLargeOpt,
    CostScope,
    CostScopeOpt,
    CostsOpt,
    DirectionsOpt,
    JsonOpt,
    MbOpt,
    MemCapOpt,
    ProfileOpt,
    RanksOpt,
    ScheduleOpt,
    SchedulesOpt,
    VOpt,
)
from ppsim.errors import PPSimError
from ppsim.io import check_writable, fmt_bytes, parse_bytes

if TYPE_CHECKING:
    from ppsim.result import SimResult

# --- simulate / plot / report -------------------------------------------------------------------------------------
@app.command("simulate")
@user_errors
def simulate_cmd(
    schedule: SchedulesOpt,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    memory_cap: MemCapOpt = None,
    json_out: JsonOpt = False,
    directions: DirectionsOpt = 1,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = CostScope.stage,
) -> None:
    """Discrete-event replay; with -s A,B,C simulates several and ranks them by makespan."""
    names = split_names(schedule)
    cost_model = build_costs(costs, profile)
    cap = parse_bytes(memory_cap)
    warn_cap_without_bytes(cap, cost_model)
    results: list[SimResult] = []
    for name in names:
        try:
            sched = build_schedule(name, ranks, mb, stages_per_rank, directions, allow_large=allow_large)
        except PPSimError as exc:
            if len(names) == 1:
                raise
            typer.echo(f"skipped {name}: {exc}", err=True)
            continue
        results.append(run_simulation(sched, cost_model, cost_scope, cap))
    if not results:
        raise PPSimError(f"--schedule {schedule!r}: none of these schedules can run this configuration (see above)")
    results.sort(key=lambda r: r.makespan)
    warn_if_not_comparable([(r.schedule.name, len(r.schedule.pipelines[0])) for r in results], cost_model, cost_scope)
    if json_out:
        echo_json(results[0].to_dict() if len(names) == 1 else [r.to_dict() for r in results])
        return
    print_results(results)


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
                str(i), r.schedule.name, f"{r.makespan:.6g}", f"{r.bubble_ratio:.1%}",
                str(max(p.peak_activations for p in r.per_rank)), fmt_bytes(max(peak_b)) if peak_b else "-",
            )
        con.print(table)
    for r in results:
        s = r.schedule
        table = Table(
            title=f"{s.name}: {s.num_ranks} ranks, {s.num_microbatches} microbatches, {s.num_stages} stages — "
            f"makespan {r.makespan:.6g} {unit}, bubble {r.bubble_ratio:.1%}"
        )
        for col in ("rank", "busy", "idle", "bubble", "peak act.", "peak bytes"):
            table.add_column(col, justify="right")
        for p in r.per_rank:
            peak = fmt_bytes(p.peak_memory_bytes) if p.peak_memory_bytes is not None else "-"
            if p.over_memory_cap:
                peak = f"[bold red]{peak} > cap[/]"
            table.add_row(str(p.rank), f"{p.busy:.6g}", f"{p.idle:.6g}", f"{p.bubble_ratio:.1%}",
                          str(p.peak_activations), peak)
        con.print(table)


PLOT_FORMATS = (".png", ".svg", ".pdf", ".html")


@app.command("plot")
@user_errors
def plot_cmd(
    schedule: ScheduleOpt,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="png/svg/pdf (static) or html (interactive).")
    ] = None,
    dpi: Annotated[int, typer.Option("--dpi", help="Resolution of png output.", min=20, max=1200)] = 200,
    memory: Annotated[bool, typer.Option("--memory", help="Add a memory-over-time panel per rank.")] = False,
    comm: Annotated[bool, typer.Option("--comm", help="Draw p2p hand-offs between ranks as arrows.")] = False,
    memory_cap: MemCapOpt = None,
    directions: DirectionsOpt = 1,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = CostScope.stage,
) -> None:
    """Gantt chart like the DualPipe figure (default file <schedule>_r<R>_m<M>.png); prints its path."""
    sched = build_schedule(schedule, ranks, mb, stages_per_rank, directions, allow_large=allow_large, figure=True)
    check_figure(sched, allow_large=allow_large)
    if output is None:
        output = Path(f"{sched.name}_r{sched.num_ranks}_m{sched.num_microbatches}.png")
    if output.suffix.lower() not in PLOT_FORMATS:
        raise PPSimError(
            f"-o {output}: unknown extension {output.suffix or '(none)'!r}; use one of {', '.join(PLOT_FORMATS)}"
        )
    check_writable(output, example="out.png")
    from ppsim.viz import plot_to_file

    cost_model = build_costs(costs, profile)
    cap = parse_bytes(memory_cap)
    warn_cap_without_bytes(cap, cost_model)
    result = run_simulation(sched, cost_model, cost_scope, cap)
    path = plot_to_file(result, output, dpi=dpi, memory=memory, comm=comm)
    typer.echo(str(path))


@app.command("report")
@user_errors
def report_cmd(
    schedule: SchedulesOpt,
    output: Annotated[Path, typer.Option("--output", "-o", help="HTML file to write (self-contained, offline).")],
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    memory_cap: MemCapOpt = None,
    directions: DirectionsOpt = 1,
    allow_large: AllowLargeOpt = False,
    cost_scope: CostScopeOpt = CostScope.stage,
) -> None:
    """One self-contained HTML page comparing schedules: ranking, Gantts, memory, bubbles."""
    if output.suffix.lower() not in (".html", ".htm"):
        raise PPSimError(f"-o {output}: a report is an HTML page; use a name ending in .html")
    check_writable(output, example="report.html")
    from ppsim.viz.report import write_report

    cost_model = build_costs(costs, profile)
    cap = parse_bytes(memory_cap)
    warn_cap_without_bytes(cap, cost_model)
    entries: list[tuple[str, SimResult | str]] = []
    for name in split_names(schedule):
        try:
            sched = build_schedule(
                name, ranks, mb, stages_per_rank, directions, allow_large=allow_large, figure=True
            )
            check_figure(sched, allow_large=allow_large)
            entries.append((sched.name, run_simulation(sched, cost_model, cost_scope, cap)))
        except PPSimError as exc:
            entries.append((name, str(exc)))
    warn_if_not_comparable(
        [(r.schedule.name, len(r.schedule.pipelines[0])) for _, r in entries if not isinstance(r, str)],
        cost_model, cost_scope,
    )
    path = write_report(entries, output, costs=cost_model, memory_cap_bytes=cap)
    typer.echo(str(path))


