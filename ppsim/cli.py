"""The `ppsim` command line (typer). Commands and options follow ../shared/cli-contract.md.

User mistakes (:class:`ppsim.errors.PPSimError`, missing or unwritable files) print one line on stderr and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional, TypeVar

import typer

from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.costs import CostModel
    from ppsim.ir import Schedule
    from ppsim.result import SimResult

app = typer.Typer(
    name="ppsim",
    help="Generate, simulate, draw, calibrate and execute pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# --- shared options -------------------------------------------------------------------------------------------
ScheduleOpt = Annotated[
    str, typer.Option("--schedule", "-s", help="Schedule name (case-insensitive, see `ppsim list`) or a .csv file.")
]
SchedulesOpt = Annotated[
    str, typer.Option("--schedule", "-s", help="One schedule, or several separated by commas (A,B,C).")
]
RanksOpt = Annotated[Optional[int], typer.Option("--ranks", "-r", help="Pipeline ranks (devices).")]
MbOpt = Annotated[Optional[int], typer.Option("--mb", "-m", help="Microbatches per step.")]
VOpt = Annotated[
    Optional[int],
    typer.Option("--stages-per-rank", "-v", help="Virtual stages per rank (interleaved/looped schedules; default 2)."),
]
DirectionsOpt = Annotated[
    int,
    typer.Option(
        "--directions",
        help="For .csv files: independent pipelines the stages form (2 for DualPipe files, see formulas.md).",
        min=1,
        max=2,
    ),
]
CostsOpt = Annotated[
    Optional[str],
    typer.Option("--costs", help='Per-op times in one unit, e.g. "F=1,B=2,I=1,W=1,FB=2.5,comm=0.1".'),
]
ProfileOpt = Annotated[
    Optional[Path], typer.Option("--profile", help="Profile JSON from `ppsim calibrate` (replaces --costs).")
]
MemCapOpt = Annotated[
    Optional[str], typer.Option("--memory-cap", help="Flag ranks whose peak memory exceeds BYTES (e.g. 80e9, 80GiB).")
]
class CostScope(str, Enum):
    stage = "stage"
    rank = "rank"


CostScopeOpt = Annotated[
    CostScope,
    typer.Option(
        "--cost-scope",
        case_sensitive=False,
        help="What --costs times describe: one stage chunk (default) or one rank's share of the model "
        "(compares schedules with different stage counts on the same model).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str) -> typer.Exit:
    """Print one error line and return the exit to raise (code 2)."""
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(code=2)


def user_errors(func: F) -> F:
    """Turn user mistakes into one line on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PPSimError as exc:
            raise fail(str(exc)) from None
        except FileNotFoundError as exc:
            raise fail(f"{exc.filename or exc}: file not found; check the path") from None
        except PermissionError as exc:
            raise fail(f"{exc.filename or exc}: permission denied; choose a writable path") from None
        except IsADirectoryError as exc:
            raise fail(f"{exc.filename or exc}: is a directory; give a file name") from None

    return wrapper  # type: ignore[return-value]


_SIZE_RE = re.compile(r"^\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | None) -> int | None:
    if text is None:
        return None
    m = _SIZE_RE.match(text)
    try:
        value = float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()] if m else -1.0
    except ValueError:
        value = -1.0
    if value <= 0:
        raise PPSimError(f"--memory-cap {text!r}: must be a positive size in bytes (e.g. 80000000000, 80GB, 80GiB)")
    return int(value)


def build_schedule(
    schedule: str, ranks: int | None, mb: int | None, v: int | None = None, directions: int = 1
) -> Schedule:
    from ppsim.schedules import load_schedule

    return load_schedule(schedule, ranks, mb, v, num_pipelines=directions)


def build_costs(costs: str | None, profile: Path | None) -> CostModel:
    from ppsim.costs import load_costs

    return load_costs(costs, profile)


def run_simulation(
    sched: Schedule, cost_model: CostModel, scope: CostScope, cap: int | None = None
) -> SimResult:
    from ppsim.costs import costs_for
    from ppsim.simulate import simulate

    return simulate(sched, costs_for(cost_model, sched, scope=scope.value), memory_cap_bytes=cap)


def warn_if_not_comparable(results: list[tuple[str, int]], cost_model: CostModel, scope: CostScope) -> None:
    """A ranking of schedules that cut the model into different stage counts is only fair per rank share."""
    lengths = {n for _, n in results}
    if len(lengths) > 1 and scope is CostScope.stage and cost_model.num_positions is None:
        detail = ", ".join(f"{name}: {n}" for name, n in results)
        typer.echo(
            f"note: these schedules cut the model into different numbers of stages ({detail}); --costs are per "
            "stage, so they describe different models; pass --cost-scope rank to compare the same model",
            err=True,
        )


def warn_cap_without_bytes(cap: int | None, cost_model: CostModel) -> None:
    if cap is not None and not cost_model.has_memory:
        typer.echo("warning: --memory-cap needs byte sizes from --profile; without one no rank can be flagged",
                   err=True)


def split_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise PPSimError(f"--schedule {text!r}: give at least one schedule name, e.g. -s DualPipeV")
    return names


def echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))


def console() -> Any:
    from rich.console import Console

    return Console()


# --- list / show / validate / export ----------------------------------------------------------------------------
@app.command("list")
@user_errors
def list_cmd(json_out: JsonOpt = False) -> None:
    """Every schedule with its stages per rank, constraints and a one-line description."""
    from ppsim.schedules import all_specs

    specs = all_specs()
    rows = [
        {
            "name": s.name,
            "aliases": list(s.aliases),
            "stages_per_rank": s.stages_per_rank_text,
            "constraints": s.constraints,
            "description": s.description,
            "torch": s.torch_name,
        }
        for s in specs
    ]
    if json_out:
        echo_json(rows)
        return
    from rich.table import Table

    table = Table(title="ppsim schedules")
    for col in ("schedule", "stages/rank", "constraints", "description"):
        table.add_column(col, overflow="fold")
    for r in rows:
        name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        table.add_row(name, r["stages_per_rank"], r["constraints"], r["description"])
    console().print(table)


@app.command("show")
@user_errors
def show_cmd(
    schedule: ScheduleOpt,
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    directions: DirectionsOpt = 1,
) -> None:
    """The order as a text grid, one row per rank."""
    from ppsim.formats import to_text_grid

    sched = build_schedule(schedule, ranks, mb, stages_per_rank, directions)
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
    directions: DirectionsOpt = 1,
) -> None:
    """Check a schedule file; exit 0 and `valid`, or exit 1 with one line per problem."""
    from ppsim.formats import read_schedule_file, schedule_from_rows
    from ppsim.validate import Problem, validate

    sf = read_schedule_file(file)
    if sf.dropped_note:
        typer.echo(f"note: {sf.dropped_note}", err=True)
    try:
        sched = schedule_from_rows(sf.rows, name=file.stem, num_microbatches=mb, num_pipelines=directions)
        problems = validate(sched)
    except PPSimError as exc:  # placement problems are problems of the file, not of the command line
        problems = [Problem(None, None, None, str(exc))]
    if not problems:
        typer.echo("valid")
        return
    for p in problems:
        typer.echo(str(p))
    if directions == 1 and any("deadlock" in p.message for p in problems) and len(sf.rows) > 1:
        typer.echo("hint: a DualPipe file (two independent pipelines) needs --directions 2", err=True)
    raise typer.Exit(code=1)


class ExportFormat(str, Enum):
    csv = "csv"
    json = "json"
    chrome = "chrome"


@app.command("export")
@user_errors
def export_cmd(
    schedule: ScheduleOpt,
    output: Annotated[Path, typer.Option("--output", "-o", help="File to write.")],
    ranks: RanksOpt = None,
    mb: MbOpt = None,
    stages_per_rank: VOpt = None,
    fmt: Annotated[
        ExportFormat, typer.Option("--format", case_sensitive=False, help="csv (torch), json (timed), chrome (trace).")
    ] = ExportFormat.csv,
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    directions: DirectionsOpt = 1,
    cost_scope: CostScopeOpt = CostScope.stage,
) -> None:
    """Write the schedule as torch's compute-only CSV, timed JSON, or a Chrome/Perfetto trace."""
    sched = build_schedule(schedule, ranks, mb, stages_per_rank, directions)
    check_writable(output)
    if fmt is ExportFormat.csv:
        from ppsim.formats import write_csv

        path = write_csv(sched, output)
    else:
        from ppsim import export

        result = run_simulation(sched, build_costs(costs, profile), cost_scope)
        writer = export.write_json_timeline if fmt is ExportFormat.json else export.write_chrome_trace
        path = writer(result, output)
    typer.echo(str(path))


def check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise PPSimError(f"-o {path}: is a directory; give a file name such as {path / 'out.csv'}")
    if not parent.is_dir():
        raise PPSimError(f"-o {path}: folder {parent} does not exist; create it or choose another path")
    import os

    if not os.access(parent, os.W_OK):
        raise PPSimError(f"-o {path}: folder {parent} is not writable; choose another path")


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
            sched = build_schedule(name, ranks, mb, stages_per_rank, directions)
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


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


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
    cost_scope: CostScopeOpt = CostScope.stage,
) -> None:
    """Gantt chart like the DualPipe figure (default file <schedule>_r<R>_m<M>.png); prints its path."""
    sched = build_schedule(schedule, ranks, mb, stages_per_rank, directions)
    if output is None:
        output = Path(f"{sched.name}_r{sched.num_ranks}_m{sched.num_microbatches}.png")
    if output.suffix.lower() not in PLOT_FORMATS:
        raise PPSimError(
            f"-o {output}: unknown extension {output.suffix or '(none)'!r}; use one of {', '.join(PLOT_FORMATS)}"
        )
    check_writable(output)
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
    cost_scope: CostScopeOpt = CostScope.stage,
) -> None:
    """One self-contained HTML page comparing schedules: ranking, Gantts, memory, bubbles."""
    if output.suffix.lower() not in (".html", ".htm"):
        raise PPSimError(f"-o {output}: a report is an HTML page; use a name ending in .html")
    check_writable(output)
    from ppsim.viz.report import write_report

    cost_model = build_costs(costs, profile)
    cap = parse_bytes(memory_cap)
    warn_cap_without_bytes(cap, cost_model)
    entries: list[tuple[str, SimResult | str]] = []
    for name in split_names(schedule):
        try:
            sched = build_schedule(name, ranks, mb, stages_per_rank, directions)
            entries.append((sched.name, run_simulation(sched, cost_model, cost_scope, cap)))
        except PPSimError as exc:
            entries.append((name, str(exc)))
    warn_if_not_comparable(
        [(r.schedule.name, len(r.schedule.pipelines[0])) for _, r in entries if not isinstance(r, str)],
        cost_model, cost_scope,
    )
    path = write_report(entries, output, costs=cost_model, memory_cap_bytes=cap)
    typer.echo(str(path))


# --- calibrate / run (torch; imported lazily inside the commands) --------------------------------------------------
def _register_torch_commands() -> None:
    from ppsim.calibrate.commands import register
    from ppsim.viz.run_figure import plot_run

    register(app, wrap=user_errors, plot_run=plot_run)


_register_torch_commands()


def main() -> None:
    """Console entry point: typer's own parse errors become one line too (exit 2)."""
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # bad option values, unknown commands
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        typer.echo(f"Error: {message}{where}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
