"""Helpers the command modules share: error handling, building schedules and costs, printing."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import typer

from ppsim.cli.options import CostScope
from ppsim.errors import PPSimError

if TYPE_CHECKING:
    from ppsim.costs import CostModel
    from ppsim.ir import Schedule
    from ppsim.result import SimResult

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


def build_schedule(
    schedule: str,
    ranks: int | None,
    mb: int | None,
    v: int | None = None,
    directions: int = 1,
    *,
    allow_large: bool = False,
    figure: bool = False,
) -> Schedule:
    """The schedule to use, through :func:`ppsim.load.load`: bounded (figure limits for plot/report), sizes from a
    file, files validated."""
    from ppsim.load import load

    loaded = load(
        schedule, num_ranks=ranks, num_microbatches=mb, num_stages_per_rank=v, num_pipelines=directions,
        allow_large=allow_large, figure=figure,
    )
    for note in loaded.notes:
        typer.echo(f"note: {note}", err=True)
    return loaded.schedule


def check_figure(sched: Schedule, *, allow_large: bool = False) -> None:
    """Refuse a figure too big to draw within the limits (:func:`ppsim.limits.check_figure`)."""
    from ppsim.limits import check_figure as check

    check(sched.name, sched.num_ranks, sched.num_actions, allow_large=allow_large)


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
