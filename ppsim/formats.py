"""torch's schedule CSV: read (compute-only or compute+comms) and write (compute-only).

No header; row i is rank i; an empty cell is an idle slot; cells are torch action strings. What
``_PipelineScheduleRuntime._load_csv(format="compute_only")`` reads, ppsim writes.
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ppsim.errors import ScheduleFormatError
from ppsim.io import write_atomic  # noqa: F401  (re-exported: the one atomic writer lives in ppsim.io)
from ppsim.ir import Action, Schedule, parse_action


@dataclass(frozen=True)
class ScheduleFile:
    """A schedule file as written: per-rank cells (``None`` = idle), before any consistency check."""

    path: str
    rows: tuple[tuple[Action | None, ...], ...]
    dropped: tuple[tuple[str, int], ...] = ()
    """Non-compute actions that were dropped, with counts (``SEND_F``: 12, ...)."""

    @property
    def dropped_note(self) -> str | None:
        if not self.dropped:
            return None
        kinds = ", ".join(f"{n} {kind}" for kind, n in self.dropped)
        return f"{self.path}: kept compute actions only, dropped {kinds}"


def read_schedule_file(path: str | os.PathLike[str]) -> ScheduleFile:
    """Parse a torch CSV (compute-only or compute+comms). Communication/FSDP actions are dropped and counted."""
    p = Path(path)
    if p.is_dir():
        raise ScheduleFormatError(f"schedule file {str(p)!r} is a directory: pass a CSV file with one row per rank")
    if not p.is_file():
        raise ScheduleFormatError(f"schedule file {str(p)!r} not found: check the path (a CSV with one row per rank)")
    text = p.read_text(encoding="utf-8")
    rows: list[tuple[Action | None, ...]] = []
    dropped: Counter[str] = Counter()
    for r, cells in enumerate(csv.reader(io.StringIO(text))):
        row: list[Action | None] = []
        for c, cell in enumerate(cells):
            try:
                action = parse_action(cell)
            except ScheduleFormatError as exc:
                raise ScheduleFormatError(f"{p}: rank {r}, position {c}: {exc}") from None
            if action is not None and not action.is_compute:
                dropped[action.type.value] += 1
                continue
            row.append(action)
        rows.append(tuple(row))
    while rows and not any(a is not None for a in rows[-1]):
        rows.pop()  # trailing blank lines
    if not rows:
        raise ScheduleFormatError(f"schedule file {str(p)!r} is empty: expected one row of actions per rank, e.g. 0F0,0B0")
    return ScheduleFile(str(p), tuple(rows), tuple(sorted(dropped.items())))


def schedule_from_rows(
    rows: tuple[tuple[Action | None, ...], ...],
    *,
    name: str,
    num_microbatches: int | None = None,
    num_pipelines: int = 1,
) -> Schedule:
    """Build a :class:`Schedule` from per-rank cells, inferring placement, stages and microbatches.

    Raises :class:`ScheduleFormatError` when the cells cannot describe one schedule (a stage on two ranks, stage
    ids with gaps); finer problems are :func:`ppsim.validate.validate`'s job.
    """
    stage_to_rank: dict[int, int] = {}
    max_mb = -1
    for r, row in enumerate(rows):
        for c, action in enumerate(row):
            if action is None:
                continue
            for comp in action.computations:
                owner = stage_to_rank.setdefault(comp.stage, r)
                if owner != r:
                    raise ScheduleFormatError(
                        f"{name}: rank {r}, position {c}: action {action} runs stage {comp.stage}, which rank {owner} "
                        "already runs; each stage must live on exactly one rank"
                    )
                if comp.microbatch is not None:
                    max_mb = max(max_mb, comp.microbatch)
    num_stages = max(stage_to_rank, default=-1) + 1
    missing = [s for s in range(num_stages) if s not in stage_to_rank]
    if num_stages == 0 or missing:
        raise ScheduleFormatError(
            f"{name}: stages must be numbered 0..S-1 without gaps; stage(s) {missing or [0]} never appear"
        )
    if num_pipelines < 1 or num_stages % num_pipelines:
        raise ScheduleFormatError(
            f"{name}: {num_stages} stages cannot form {num_pipelines} equal pipelines; use --directions 1"
        )
    chain = num_stages // num_pipelines
    pipelines = tuple(tuple(range(d * chain, (d + 1) * chain)) for d in range(num_pipelines))
    per_pipeline = max_mb + 1
    m = per_pipeline * num_pipelines if num_microbatches is None else num_microbatches
    if m < 1:
        raise ScheduleFormatError(f"{name}: no microbatch appears in any action; expected actions like 0F0")
    counts = Counter(stage_to_rank.values())
    idle = tuple(tuple(c for c, a in enumerate(row) if a is None) for row in rows)
    return Schedule(
        name=name,
        actions=tuple(tuple(a for a in row if a is not None) for row in rows),
        stage_to_rank=tuple(stage_to_rank[s] for s in range(num_stages)),
        num_microbatches=m,
        num_stages_per_rank=max(counts.values()),
        pipelines=pipelines,
        idle_slots=idle,
    )


def read_csv(
    path: str | os.PathLike[str], *, num_microbatches: int | None = None, num_pipelines: int = 1
) -> Schedule:
    """Read a torch CSV into a :class:`Schedule` (name = file stem)."""
    sf = read_schedule_file(path)
    return schedule_from_rows(
        sf.rows, name=Path(path).stem, num_microbatches=num_microbatches, num_pipelines=num_pipelines
    )


def to_csv_text(schedule: Schedule) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")
    for row in schedule.to_rows():
        writer.writerow(row)
    return buf.getvalue()


def write_csv(schedule: Schedule, path: str | os.PathLike[str]) -> Path:
    """Write torch's compute-only CSV (loads with ``_PipelineScheduleRuntime._load_csv``)."""
    return write_atomic(path, to_csv_text(schedule))


def to_text_grid(schedule: Schedule) -> str:
    """The order as aligned text, one row per rank (``ppsim show``)."""
    rows = schedule.to_rows()
    width = max((len(c) for row in rows for c in row), default=1)
    label = len(f"rank {schedule.num_ranks - 1}")
    lines = [
        f"{f'rank {r}':<{label}} | " + " ".join(f"{c or '.':<{width}}" for c in row).rstrip()
        for r, row in enumerate(rows)
    ]
    return "\n".join(lines)
