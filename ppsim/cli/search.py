"""`ppsim search`: the fastest order found for the given costs under a per-rank memory cap (ppsim.search)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ppsim.cli._app import app
from ppsim.cli.common import build_costs, check_outputs_apart, console, echo_json, user_errors
from ppsim.cli.options import AllowLargeOpt, CostScopeOpt, CostsOpt, JsonOpt, ProfileOpt, RecomputeOpt, output_file
from ppsim.errors import PPSimError
from ppsim.io import MemoryCap, check_writable, fmt_bytes
from ppsim.search.choices import SEARCH_NAME, Placement, Solver

if TYPE_CHECKING:
    from ppsim.costs import CostSpec
    from ppsim.ir import Schedule
    from ppsim.search import Progress, SearchResult
    from ppsim.search.recompute import RecomputeResult


@app.command("search")
@user_errors
def search_cmd(
    ranks: Annotated[int, typer.Option("--ranks", "-r", help="Pipeline ranks (devices).")],
    mb: Annotated[int, typer.Option("--mb", "-m", help="Microbatches per step.")],
    memory_cap: Annotated[
        str,
        typer.Option("--memory-cap", help="Per-rank cap: activations (8act, the unit of peak_activations) or "
                     "bytes (80GiB, 1.5e9; needs --profile)."),
    ],
    costs: CostsOpt = None,
    profile: ProfileOpt = None,
    placement: Annotated[
        Placement,
        typer.Option("--placement", case_sensitive=False, help="loop (stage s on rank s % R), v (rank r holds r "
                     "and 2R-1-r) or any (both)."),
    ] = Placement.loop,
    stages_per_rank: Annotated[
        Optional[int], typer.Option("--stages-per-rank", "-v", help="Stages per rank for loop placement (default 1).")
    ] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds to search (default 10).")] = 10.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives the same order.")] = 0,
    max_orders: Annotated[
        Optional[int],
        typer.Option("--max-orders", min=1, help="Stop after trying this many orders (reproducible regardless of "
                     "machine speed when it, not --time-limit, ends the search)."),
    ] = None,
    solver: Annotated[
        Solver, typer.Option("--solver", case_sensitive=False, help="auto: polish with CP-SAT when OR-Tools is "
                             "installed (the 'search' extra); cpsat: require it; none: never.")
    ] = Solver.auto,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", parser=output_file,
                                     help="Write the order as torch's compute-only CSV.")
    ] = None,
    cost_scope: CostScopeOpt = None,
    json_out: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines on stderr.")] = False,
    allow_large: AllowLargeOpt = False,
    recompute: RecomputeOpt = None,
) -> None:
    """Search for the order with the smallest simulated makespan that fits the memory cap on every rank."""
    from ppsim.search import search

    auto = _recompute_mode(recompute)
    if output is not None:
        check_writable(output, example="best.csv")
        check_outputs_apart([("-o", output)], inputs=[("--profile", profile)])
    cost_model = build_costs(costs, profile)
    show = not quiet and not json_out

    def progress(p: Progress) -> None:
        if show:
            best = "no order yet" if p.best_makespan == float("inf") else f"best {p.best_makespan:.6g}"
            typer.echo(f"  {p.elapsed_s:5.1f}s  {p.evaluations:6d} orders  {best}  "
                       f"(bound {p.lower_bound:.6g}, {p.phase})", err=True)

    try:
        if auto:
            _search_recompute(ranks, mb, cost_model, memory_cap, placement=placement, stages_per_rank=stages_per_rank,
                              time_limit=time_limit, seed=seed, cost_scope=cost_scope, max_orders=max_orders,
                              solver=solver, progress=progress, output=output, json_out=json_out)
            return
        result = search(ranks, mb, cost_model, memory_cap, placement=placement, num_stages_per_rank=stages_per_rank,
                        time_limit=time_limit, seed=seed, cost_scope=None if cost_scope is None else cost_scope.value,
                        max_orders=max_orders, solver=solver, progress=progress, allow_large=allow_large)
    except KeyboardInterrupt:
        typer.echo("Interrupted: no order yet (the search had not found one that fits).", err=True)
        raise typer.Exit(code=130) from None
    if output is not None:
        from ppsim.formats import to_csv_text
        from ppsim.io import write_atomic

        write_atomic(output, to_csv_text(result.schedule))
    if json_out:
        data = result.to_dict()
        data["output"] = None if output is None else str(output)
        echo_json(data)
    else:
        print_search(result)
        if output is not None:
            typer.echo(str(output))
    if result.stopped == "interrupted":
        typer.echo("Interrupted: the best order found so far is shown" + (" and written." if output else "."), err=True)
        raise typer.Exit(code=130)


def _recompute_mode(option: str | None) -> bool:
    """Whether `search --recompute` asks for auto (none: the plain search)."""
    from ppsim.recompute import Recompute, RecomputeError

    if option is None or option.strip().lower() == Recompute.none.value:
        return False
    if option.strip().lower() == Recompute.auto.value:
        return True
    raise RecomputeError(f"--recompute {option!r}: search takes none or auto (auto chooses what to recompute to meet "
                         "--memory-cap); to time a fixed set, pass it to `ppsim simulate --recompute`")


def _search_recompute(ranks: int, mb: int, cost_model: CostSpec, memory_cap: str, *, output: Path | None,
                      json_out: bool, stages_per_rank: int | None, cost_scope: object, **kwargs: object) -> None:
    """`search --recompute auto`: the order (torch's compute-only CSV) and the set beside it (<stem>.recompute.json)."""
    from ppsim.recompute import sidecar_path, write_sidecar
    from ppsim.search.recompute import search_recompute

    scope = getattr(cost_scope, "value", cost_scope)
    result = search_recompute(ranks, mb, cost_model, memory_cap, num_stages_per_rank=stages_per_rank,
                              cost_scope=None if scope is None else str(scope), **kwargs)  # type: ignore[arg-type]
    side = None
    if output is not None:
        from ppsim.formats import to_csv_text
        from ppsim.io import write_atomic

        write_atomic(output, to_csv_text(result.schedule))
        side = write_sidecar(sidecar_path(output), result.recompute, result.schedule, cap=str(result.cap),
                             makespan=result.makespan, uncapped_makespan=result.uncapped.makespan,
                             costs=cost_model.to_dict())
    if json_out:
        data = result.to_dict()
        data["output"] = None if output is None else str(output)
        data["recompute_file"] = None if side is None else str(side)
        echo_json(data)
        return
    print_search_recompute(result)
    if output is not None:
        typer.echo(str(output))
        typer.echo(str(side))


def print_search_recompute(result: RecomputeResult) -> None:
    """The chosen order and set, every order tried, and the time lost against the uncapped best."""
    from rich.table import Table

    from ppsim.search.common import peak_of

    cap = result.cap
    s = result.schedule
    table = Table(title=f"search --recompute auto: {s.num_ranks} ranks, {s.num_microbatches} microbatches, cap "
                        f"{cap if cap.unit == 'act' else fmt_bytes(cap.amount)} per rank ({result.sim.unit})")
    for col in ("order", "makespan", "recomputed", "time lost"):
        table.add_column(col)
    base = result.uncapped.makespan
    for source, makespan, count in sorted(result.tried, key=lambda x: x[1]):
        if makespan == float("inf"):
            table.add_row(source, "does not fit", "-", "-", style="dim")
            continue
        table.add_row(source, f"{makespan:.6g}", str(count), f"{makespan / base - 1:+.1%}",
                      style="bold" if source == result.source or result.source.startswith(source) else None)
    con = console()
    con.print(table)
    total = s.num_stages * s.num_microbatches
    con.print(f"chosen: {result.source}, makespan {result.makespan:.6g}, peak {_peak_text(result.peak, cap.unit)}, "
              f"recomputing {len(result.recompute)} of {total} (stage, microbatch) activations", highlight=False)
    con.print(f"uncapped best {base:.6g} (peak {_peak_text(peak_of(result.uncapped.sim, cap.unit), cap.unit)}): "
              f"time lost {result.time_lost:+.1%}; {result.elapsed_s:.1f}s", highlight=False)


def searched_for_report(
    ranks: int | None, mb: int | None, cost_model: CostSpec, memory_cap: str | None, cost_scope: object,
    time_limit: float, *, allow_large: bool = False,
) -> tuple[Schedule, MemoryCap]:
    """`ppsim report --search`: the searched order (placement any) and the cap to flag ranks with."""
    from ppsim.search import search

    if ranks is None or mb is None or memory_cap is None:
        raise PPSimError("--search needs -r, -m and --memory-cap (e.g. -r 4 -m 16 --memory-cap 8act)")
    scope = getattr(cost_scope, "value", cost_scope)
    result = search(ranks, mb, cost_model, memory_cap, placement=Placement.any, time_limit=time_limit,
                    cost_scope=None if scope is None else str(scope), allow_large=allow_large)
    typer.echo(f"searched: {result.makespan:.6g} ({result.source}); {bound_line(result)}", err=True)
    from dataclasses import replace

    return replace(result.schedule, name=SEARCH_NAME), result.cap


def check_time_limit(value: float, option: str) -> None:
    """A time limit is a positive, finite number of seconds (NaN, inf and 0 are refused in one line)."""
    import math

    if not math.isfinite(value) or value <= 0:
        raise PPSimError(f"{option} {value}: must be a positive number of seconds; e.g. {option} 10")


def bound_line(result: SearchResult) -> str:
    """``optimal`` when the makespan meets the lower bound, else the proven gap; and what proved the bound."""
    how = "CP-SAT" if result.bound_source == "CP-SAT" else "the analytic bound, docs/search.md"
    if result.optimal:
        return f"optimal: no order is faster (lower bound {result.lower_bound:.6g}, proven by {how})"
    return f"lower bound {result.lower_bound:.6g} (proven by {how}), gap {result.gap:.1%}"


def _peak_text(value: float, unit: str) -> str:
    return fmt_bytes(value) if unit == "bytes" else f"{value:g}"


def print_search(result: SearchResult) -> None:
    """The searched order beside every named schedule of the same placement, fastest first; bound and gap."""
    from rich.table import Table

    unit = result.sim.unit
    cap = result.cap
    table = Table(title=f"search: {result.schedule.num_ranks} ranks, {result.schedule.num_microbatches} microbatches, "
                        f"cap {cap if cap.unit == 'act' else fmt_bytes(cap.amount)} per rank ({unit})")
    for col in ("schedule", "makespan", "bubble", "peak", "fits"):
        table.add_column(col)
    rows = [(f"searched ({result.source})", result.makespan, result.bubble_ratio, result.peak, True, True)]
    rows += [(n.name, n.makespan, n.bubble_ratio, n.peak, n.fits, False) for n in result.named]
    for name, makespan, bubble, peak, fits, ours in sorted(rows, key=lambda x: (not x[4], x[1])):
        style = "bold" if ours else ("dim" if not fits else None)
        table.add_row(name, f"{makespan:.6g}", f"{bubble:.1%}", _peak_text(peak, cap.unit), "yes" if fits else "no",
                      style=style)
    con = console()
    con.print(table)
    best = result.best_named
    lines = [bound_line(result)]
    if best is not None:
        gain = (best.makespan - result.makespan) / best.makespan
        if gain > 1e-12:
            lines.append(f"best named that fits: {best.name} {best.makespan:.6g}; searched is {gain:.1%} faster")
        else:
            lines.append(f"best named that fits: {best.name} {best.makespan:.6g} (returned: nothing faster found)")
    else:
        lines.append("no named schedule fits the cap")
    lines.append(f"{result.evaluations} orders in {result.elapsed_s:.1f}s ({result.stopped}), seed {result.seed}, "
                 f"cost scope {result.cost_scope}")
    for line in lines:
        con.print(line, highlight=False)
