"""Helpers the command modules share: error handling, building schedules and costs, printing."""

from __future__ import annotations

import errno
import functools
import gc
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from ppsim.cli.output import console, echo_json  # noqa: F401  (the commands import them from here)
from ppsim.compare import CostScope
from ppsim.errors import PPSimError, RankLostError

if TYPE_CHECKING:
    from ppsim.compare import Comparison
    from ppsim.costs import CostSpec
    from ppsim.io import MemoryCap
    from ppsim.ir import Schedule
    from ppsim.job.cache import JobCache
    from ppsim.job.pipeline import TorchtitanJob
    from ppsim.result import SimResult

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str) -> typer.Exit:
    """Print one error line and return the exit to raise (code 2)."""
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(code=2)


def os_error_line(exc: OSError) -> str:
    """One line for an OSError a user caused (a missing file, a name too long...), naming the file."""
    name = exc.filename if exc.filename is not None else ""
    text = str(name)
    if len(text) > 120:
        text = f"{text[:60]}...{text[-30:]}"
    reasons = {
        errno.ENOENT: "file not found; check the path",
        errno.EACCES: "permission denied; choose a path you can read or write",
        errno.EISDIR: "is a directory; give a file name",
        errno.ENAMETOOLONG: "the file name is longer than the file system allows; choose a shorter name",
        errno.ENOTDIR: "a part of the path is not a folder; check the path",
        errno.ELOOP: "too many levels of symbolic links; fix the link",
    }
    reason = reasons.get(exc.errno or 0, f"{exc.strerror or exc}; check the path")
    return f"{text}: {reason}" if text else reason


def user_errors(func: F) -> F:
    """Turn user mistakes into one line on stderr and exit code 2, and Ctrl-C into "Interrupted." and exit code 130
    (typer would turn it into a silent exit 130)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        collecting = gc.isenabled()  # build_schedule pauses the collector for the rest of the command
        try:
            return func(*args, **kwargs)
        except KeyboardInterrupt:
            typer.echo("Interrupted.", err=True)
            raise typer.Exit(code=130) from None
        except PPSimError as exc:
            raise fail(str(exc)) from None
        except RankLostError as exc:  # not a user mistake: exit 1, still one line
            typer.echo(f"Error: {exc}", err=True)
            raise typer.Exit(code=1) from None
        except MemoryError:  # --allow-large lifts the estimates, not the duty to fail in one line
            raise fail("out of memory: the sizes asked for need more memory than this machine has; lower them "
                       "(layers, ranks, microbatches, sequence length) or use a machine with more memory") from None
        except OSError as exc:
            if exc.filename is None:
                raise
            raise fail(os_error_line(exc)) from None
        finally:
            if collecting:
                gc.enable()

    return wrapper  # type: ignore[return-value]


def one_schedule(values: str | list[str]) -> str:
    """The one schedule a single-schedule command takes; a repeated -s is an error, never 'the last one wins'."""
    values = [values] if isinstance(values, str) else values
    if len(values) != 1:
        raise PPSimError(
            f"--schedule given {len(values)} times ({', '.join(values)}): this command takes one schedule; "
            "pass one -s, or use `ppsim simulate` or `ppsim report` to compare several"
        )
    if "," in values[0] and not values[0].lower().endswith(".csv"):
        raise PPSimError(
            f"--schedule {values[0]!r}: this command takes one schedule; pass one name, or use `ppsim simulate` or "
            "`ppsim report` to compare several"
        )
    return values[0]


def split_names(values: str | list[str]) -> list[str]:
    """Schedule names from one or more -s values, each possibly a comma-separated list."""
    values = [values] if isinstance(values, str) else values
    names = [n.strip() for text in values for n in text.split(",") if n.strip()]
    if not names:
        raise PPSimError(f"--schedule {','.join(values)!r}: give at least one schedule name, e.g. -s DualPipeV")
    return names


def check_outputs_apart(outputs: list[tuple[str, Path | None]], *, schedules: list[str] | str | None = None,
                        inputs: Sequence[tuple[str, str | Path | None]] = ()) -> None:
    """Refuse an output that is one of the command's input files (a schedule CSV, a profile) or another output."""
    from ppsim.io import check_distinct

    names = [] if not schedules else split_names(schedules)
    files: list[tuple[str, Any]] = [("-s", n) for n in names if n.lower().endswith(".csv")]
    check_distinct([*files, *inputs, *outputs])


def warn(lines: Any) -> None:
    for line in lines:
        typer.echo(line, err=True)


def build_schedule(
    schedule: str,
    ranks: int | None,
    mb: int | None,
    v: int | None = None,
    directions: int | None = None,
    *,
    allow_large: bool = False,
    figure: bool = False,
    check: bool = True,
) -> Schedule:
    """Build one schedule (bounded, a file validated unless ``check=False``; ``figure`` for plot/report); warnings
    go to stderr."""
    from ppsim.compare import build

    # The schedule (up to millions of Actions, no reference cycles) lives until the command ends; with the cyclic
    # collector on, its first pass after the build walks every Action (a quarter of a 1M-action `simulate`). So it
    # stays paused until the command returns (:func:`user_errors` restores it); reference counting frees as before.
    gc.disable()
    sched, notes = build(
        schedule, ranks, mb, v, num_pipelines=directions, allow_large=allow_large, figure=figure, check=check
    )
    warn(notes)
    return sched


def check_figure(sched: Schedule, *, allow_large: bool = False) -> None:
    """Refuse a figure too big to draw within the limits (:func:`ppsim.limits.check_figure`)."""
    from ppsim.limits import check_figure as check

    check(sched.name, sched.num_ranks, sched.num_actions, allow_large=allow_large)


def build_costs(
    costs: str | None, profile: Path | None, split: str | None = None, layers_per_stage: int | None = None
) -> CostSpec:
    from ppsim.costs import load_costs

    spec = load_costs(costs, profile, split=split, layers_per_stage=layers_per_stage)
    warn_host(spec.profile, profile)
    return spec


def warn_host(loaded: Any, path: Path | None) -> None:
    """Repeat, on stderr, the calibration's warning when the profile was measured on a busy host."""
    if path is None:  # no profile given: nothing to repeat (and the schema module stays unloaded)
        return
    from ppsim.profile import Profile

    line = loaded.host_warning(str(path)) if isinstance(loaded, Profile) and path is not None else None
    if line:
        typer.echo(line, err=True)


@dataclass(frozen=True)
class Inputs:
    """What a simulation command runs: schedule names, ranks, microbatches, stages per rank and the cost model."""

    names: list[str]
    ranks: int | None
    mb: int | None
    stages_per_rank: int | None
    cost_model: CostSpec
    job: TorchtitanJob | None = None
    """The torchtitan job config these came from (its keys, not -r/-m, are named when a schedule is refused)."""
    job_cache: JobCache | None = None
    """The command's access to the job cache (its settings, pipeline and shapes; :mod:`ppsim.job.cache`)."""

    def schedule(self, name: str, directions: int | None = None, *, allow_large: bool = False,
                 figure: bool = False) -> Schedule:
        """Build ``name`` with these ranks, microbatches and stages per rank (:func:`build_schedule`)."""
        try:
            return build_schedule(name, self.ranks, self.mb, self.stages_per_rank, directions,
                                  allow_large=allow_large, figure=figure)
        except PPSimError as exc:
            if self.job is None:
                raise
            raise self.job.refusal(exc) from None


def build_inputs(
    schedule: list[str] | str | None,
    ranks: int | None,
    mb: int | None,
    stages_per_rank: int | None,
    *,
    costs: str | None,
    profile: Path | None,
    split: str | None = None,
    layers_per_stage: int | None = None,
    torchtitan_config: str | Path | None = None,
    overrides: list[str] | None = None,
) -> Inputs:
    """Schedules and costs from the options, or from a torchtitan job config (which must agree with them);
    ``overrides``: the job config's overrides (``--parallelism.KEY VALUE``, from :func:`job_overrides`)."""
    overrides = overrides or []
    cost_model = build_costs(costs, profile, split, layers_per_stage)
    given = None if not schedule else split_names(schedule)
    if torchtitan_config is None:
        if given is None:
            raise PPSimError("--schedule/-s is required (or --torchtitan-config MODULE:CONFIG or job.toml); e.g. "
                             "-s 1F1B -r 4 -m 8")
        return Inputs(given, ranks, mb, stages_per_rank, cost_model)
    from ppsim.split import parse_split

    if given is not None and len(given) > 1:
        raise PPSimError(f"--schedule {','.join(given)!r} with --torchtitan-config: the job config runs one "
                         "schedule; drop -s or give that one")
    from ppsim.calibrate.torchtitan.config import load_job
    from ppsim.job.cache import JobCache

    blocks = cost_model.profile
    cache = JobCache()
    job = load_job(
        str(torchtitan_config), overrides, cache=cache,
        num_layers=None if blocks is None else blocks.num_layers,
        model=None if blocks is None else blocks.model,
        schedule=None if given is None else given[0], num_ranks=ranks, num_microbatches=mb,
        stages_per_rank=stages_per_rank, layers_per_stage=layers_per_stage,
        split=None if split is None else parse_split(split),
    )
    warnings = job.warnings
    if profile is not None and blocks is not None:  # the pass measured at the job's TP degree and microbatch size
        blocks.check_expert_parallel(job.expert_parallel_degree, source=str(profile))
        chosen = blocks.entry(tp=job.tensor_parallel_degree, mb_size=job.microbatch_size, source=str(profile))
        if chosen.model.mb_size != blocks.model.mb_size and chosen.model.mb_size == job.microbatch_size:
            warnings = tuple(w for w in warnings if not w.startswith("the profile was measured with seq_len"))
        cost_model = replace(cost_model, profile=chosen)
    elif profile is not None:
        from ppsim.profile import load_profile

        loaded = load_profile(profile)
        loaded.check_tensor_parallel(job.tensor_parallel_degree, source=str(profile))
        loaded.check_expert_parallel(job.expert_parallel_degree, source=str(profile))
    if profile is not None and blocks is not None and job.activation_checkpoint is not None:
        # the config's checkpointing against the mode the profile's blocks were timed under
        line = blocks.check_activation_checkpoint(job.activation_checkpoint, source=str(profile))
        warnings = (*warnings, *([] if line is None else [line]))
    warn(f"warning: {line}" for line in warnings)
    if blocks is not None:
        cost_model = cost_model.with_split(job.split)
    return Inputs([job.schedule], job.num_ranks, job.num_microbatches, job.stages_per_rank, cost_model, job, cache)


def job_overrides(ctx: typer.Context, torchtitan_config: object) -> list[str]:
    """The extra arguments of a command that takes --torchtitan-config (:func:`ppsim.job.overrides.extra_overrides`)."""
    if not ctx.args:  # none given: nothing to check (and the torchtitan module stays unloaded)
        return []
    from ppsim.job.overrides import extra_overrides

    names = [opt for p in ctx.command.params for opt in (*p.opts, *p.secondary_opts)]
    return extra_overrides(ctx.args, job_given=torchtitan_config is not None, option_names=names,
                           command=ctx.command_path)


def run_simulation(
    sched: Schedule, cost_model: CostSpec, scope: CostScope | None, cap: MemoryCap | None = None,
    recompute: AbstractSet[tuple[int, int]] = frozenset(),
) -> SimResult:
    from ppsim.simulator import simulate

    chosen = CostScope.stage if scope is None else scope
    return simulate(sched, cost_model.for_schedule(sched, scope=chosen.value), memory_cap=cap,
                    recompute=recompute)


def recompute_for(option: str | None) -> Callable[[str, Schedule], AbstractSet[tuple[int, int]]]:
    """``--recompute`` as a function of (schedule name or CSV path, built schedule): the recomputed pairs; a set
    read from beside a CSV is said on stderr."""
    from ppsim.recompute import resolve

    def chosen(name: str, schedule: Schedule) -> AbstractSet[tuple[int, int]]:
        csv = name if name.lower().endswith(".csv") else None
        pairs, note = resolve(option, schedule, csv_path=csv)
        if note:
            warn([note])
        return pairs

    return chosen


def warn_comparison(comparison: Comparison, *, several: bool) -> None:
    """Skipped schedules, ignored options and (for a comparison) the cost scope used, on stderr."""
    for s in comparison.skipped:
        typer.echo(f"skipped {s.name}: {s.reason}", err=True)
    warn(comparison.notes)
    if several:
        typer.echo(comparison.scope_text, err=True)


def warn_cap_without_bytes(cap: MemoryCap | None, cost_model: CostSpec) -> None:
    if cap is not None and cap.bytes is not None and not cost_model.has_memory:
        typer.echo("warning: --memory-cap needs byte sizes from --profile; without one no rank can be flagged",
                   err=True)


