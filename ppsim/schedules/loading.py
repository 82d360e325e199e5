"""Loading a schedule for use: the one entry every command that reads a schedule goes through.

:func:`load_schedule` takes a registry name or a torch CSV and returns a :class:`Schedule` that is safe to
simulate, draw, report, export or run:

- the work is estimated before anything is built and refused beyond :mod:`ppsim.limits` (``allow_large``
  overrides);
- a CSV's ranks, microbatches and stages per rank come from the file; a given ``num_ranks`` /
  ``num_microbatches`` / ``num_stages_per_rank`` that disagrees is a one-line error;
- a CSV is validated with :func:`ppsim.validate.validate`'s rules and messages (an incomplete file, a 2024-style
  file with both ``B`` and ``I``/``W``, a forwards-only file, a deadlocking order are refused with one line).

:func:`load_for_validation` is what ``ppsim validate`` uses: the same reading and limits, with ``-m`` meaning "check
the file against this many microbatches" rather than a claim that must match.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ppsim import limits
from ppsim.errors import ScheduleConfigError, ScheduleFormatError
from ppsim.formats import ScheduleFile, display_path, read_schedule_file, schedule_from_rows
from ppsim.ir import ActionType, Schedule


class InvalidScheduleError(ScheduleFormatError):
    """A schedule file breaks :func:`ppsim.validate.validate`'s rules; ``problems`` holds every problem found."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems or [])


@dataclass(frozen=True)
class LoadedSchedule:
    """A schedule ready for use, and the notes a command should print on stderr (dropped comm actions, ...)."""

    schedule: Schedule
    notes: tuple[str, ...] = ()
    from_file: bool = False


def is_schedule_file(source: str | os.PathLike[str]) -> bool:
    """A ``.csv`` name (any case) is a file; anything else is a registry name."""
    return str(source).lower().endswith(".csv")


def load(
    source: str | os.PathLike[str],
    *,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    num_stages_per_rank: int | None = None,
    num_pipelines: int = 1,
    allow_large: bool = False,
    check: bool = True,
    figure: bool = False,
) -> LoadedSchedule:
    """A schedule by name or from a CSV, bounded and (for files) validated; see the module docstring.

    ``check=False`` skips validation of a file (for callers that report problems themselves). ``figure=True``
    applies the stricter figure limits (``plot``, ``report``) before anything is built or validated.
    """
    if is_schedule_file(source):
        return _load_file(
            source,
            num_ranks=num_ranks,
            num_microbatches=num_microbatches,
            num_stages_per_rank=num_stages_per_rank,
            num_pipelines=num_pipelines,
            allow_large=allow_large,
            check=check,
            figure=figure,
        )
    return LoadedSchedule(
        _build_named(
            str(source), num_ranks, num_microbatches, num_stages_per_rank, allow_large=allow_large, figure=figure
        )
    )


def load_schedule(
    source: str | os.PathLike[str],
    *,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    num_stages_per_rank: int | None = None,
    num_pipelines: int = 1,
    allow_large: bool = False,
) -> Schedule:
    """:func:`load` without the notes: the schedule only."""
    return load(
        source,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        num_stages_per_rank=num_stages_per_rank,
        num_pipelines=num_pipelines,
        allow_large=allow_large,
    ).schedule


def load_for_validation(
    path: str | os.PathLike[str],
    *,
    num_microbatches: int | None = None,
    num_pipelines: int = 1,
    allow_large: bool = False,
) -> tuple[ScheduleFile, Schedule]:
    """Read a file for ``ppsim validate``: bounded like :func:`load`, ``num_microbatches`` is what to check against.

    Raises :class:`ScheduleFormatError` for a file that cannot describe one schedule (``validate`` reports those as
    problems) and :class:`~ppsim.limits.WorkLimitError` / :class:`ScheduleConfigError` for the command line.
    """
    sf = read_schedule_file(path, allow_large=allow_large)
    if num_microbatches is not None:
        _positive("--mb", num_microbatches)
        num_stages = len({c.stage for row in sf.rows for a in row if a is not None for c in a.computations})
        estimate = limits.WorkEstimate(
            f"{display_path(path)} -m {num_microbatches}",
            len(sf.rows),
            num_stages * -(-num_microbatches // num_pipelines) * 2,
        )
        limits.check_work(estimate, allow_large=allow_large, max_actions=limits.MAX_FILE_ACTIONS)
    schedule = schedule_from_rows(
        sf.rows, name=display_path(Path(path).stem), num_microbatches=num_microbatches, num_pipelines=num_pipelines
    )
    return sf, schedule


# --- named schedules ---------------------------------------------------------------------------------------------
def _build_named(
    name: str, num_ranks: int | None, num_microbatches: int | None, num_stages_per_rank: int | None,
    *, allow_large: bool, figure: bool = False,
) -> Schedule:
    from ppsim.schedules import get_schedule, get_spec, resolve_stages_per_rank

    spec = get_spec(name)
    if num_ranks is None or num_microbatches is None:
        missing = "--ranks/-r" if num_ranks is None else "--mb/-m"
        raise ScheduleConfigError(f"{missing} is required with schedule name {name!r}; e.g. -r 4 -m 8")
    _positive("--ranks", num_ranks)
    _positive("--mb", num_microbatches)
    if num_stages_per_rank is not None:
        _positive("--stages-per-rank", num_stages_per_rank)
    v = resolve_stages_per_rank(spec, num_stages_per_rank)
    estimate = limits.estimate_named(spec.name, num_ranks, num_microbatches, v)
    limits.check_work(estimate, allow_large=allow_large)
    if figure:
        limits.check_figure(estimate.what, estimate.num_ranks, estimate.num_actions, allow_large=allow_large)
    return get_schedule(spec.name, num_ranks, num_microbatches, num_stages_per_rank)


def _positive(option: str, value: int) -> None:
    if value < 1:
        raise ScheduleConfigError(f"{option} {value}: must be at least 1; pass {option.split('/')[0]} 1 or more")


# --- files -------------------------------------------------------------------------------------------------------
def _load_file(
    source: str | os.PathLike[str],
    *,
    num_ranks: int | None,
    num_microbatches: int | None,
    num_stages_per_rank: int | None,
    num_pipelines: int,
    allow_large: bool,
    check: bool,
    figure: bool,
) -> LoadedSchedule:
    sf = read_schedule_file(source, allow_large=allow_large, figure=figure)
    path = display_path(source)
    schedule = schedule_from_rows(sf.rows, name=display_path(Path(source).stem), num_pipelines=num_pipelines)
    limits.check_work(
        limits.WorkEstimate(path, schedule.num_ranks, sum(1 for _ in schedule.iter_computations())),
        allow_large=allow_large,
        max_actions=limits.MAX_FILE_ACTIONS,
    )
    _check_given(path, "--ranks", "-r", num_ranks, schedule.num_ranks, "rows (one per rank)")
    _check_given(path, "--mb", "-m", num_microbatches, schedule.num_microbatches, "microbatches")
    _check_given(
        path, "--stages-per-rank", "-v", num_stages_per_rank, schedule.num_stages_per_rank, "stage(s) per rank"
    )
    if check:
        check_schedule(schedule, path=path, num_pipelines=num_pipelines)
    notes = (sf.dropped_note,) if sf.dropped_note else ()
    return LoadedSchedule(schedule, notes, from_file=True)


def _check_given(path: str, option: str, short: str, given: int | None, found: int, what: str) -> None:
    if given is not None and given != found:
        raise ScheduleConfigError(
            f"{option} {given}: {path} has {found} {what}; drop {short} (it is read from the file) "
            f"or pass {short} {found}"
        )


def check_schedule(schedule: Schedule, *, path: str, num_pipelines: int = 1) -> None:
    """Raise :class:`InvalidScheduleError` (one line, the first problem) unless ``schedule`` passes ``validate``."""
    kinds = {comp.type for _, _, comp in schedule.iter_computations()}
    if ActionType.F in kinds and not kinds & {ActionType.B, ActionType.I, ActionType.W}:
        raise InvalidScheduleError(
            f"{path} has forward actions only (no B, I or W): ppsim replays training steps, so every microbatch "
            "needs its backward; add the backward actions (e.g. 0B0 after 0F0)"
        )
    from ppsim.validate import validate

    problems = [str(p) for p in validate(schedule)]
    if not problems:
        return
    hint = ""
    dualpipe_shape = schedule.num_stages == 2 * schedule.num_ranks
    if num_pipelines == 1 and dualpipe_shape and schedule.num_ranks > 1 and all("deadlock" in p for p in problems):
        hint = " (a DualPipe file, two independent pipelines, needs --directions 2)"
    more = f" (and {len(problems) - 1:,} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    raise InvalidScheduleError(
        f"{path} is not a valid schedule: {problems[0]}{more}{hint}; run `ppsim validate {path}` for every problem",
        problems,
    )


__all__ = [
    "InvalidScheduleError",
    "LoadedSchedule",
    "check_schedule",
    "is_schedule_file",
    "load",
    "load_for_validation",
    "load_schedule",
]
