"""torch's schedule CSV: read (compute-only or compute+comms) and write (compute-only).

No header; row i is rank i; an empty cell is an idle slot; cells are torch action strings. What
``_PipelineScheduleRuntime._load_csv(format="compute_only")`` reads, ppsim writes.
"""

from __future__ import annotations

import codecs
import csv
import errno
import io
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ppsim import limits
from ppsim.errors import ScheduleFormatError
from ppsim.io import write_atomic  # noqa: F401  (re-exported: the one atomic writer lives in ppsim.io)
from ppsim.ir import Action, Schedule, parse_action

_COMPUTE_TOKEN = re.compile(r"(?<![0-9A-Za-z_])[0-9]+[FBIW][0-9]*(?![0-9A-Za-z_])", re.ASCII)


class ScheduleStructureError(ScheduleFormatError):
    """The cells parse but cannot describe one schedule (a stage on two ranks, stage ids with gaps, no actions)."""


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


def read_schedule_file(
    path: str | os.PathLike[str], *, allow_large: bool = False, figure: bool = False
) -> ScheduleFile:
    """Parse a torch CSV (compute-only or compute+comms). Communication/FSDP actions are dropped and counted.

    Refuses with one line: a path that is not a readable regular file (a directory, a FIFO, a device, a name
    longer than the OS allows), text that is not UTF-8, a file beyond :data:`ppsim.limits.MAX_FILE_BYTES` or
    holding more than :data:`ppsim.limits.MAX_FILE_ACTIONS` actions (unless ``allow_large``); with ``figure`` the
    stricter figure limits apply, checked while reading.
    """
    action_limit = limits.MAX_FIGURE_ACTIONS if figure else limits.MAX_FILE_ACTIONS
    rank_limit = limits.MAX_FIGURE_RANKS if figure else limits.MAX_RANKS
    p = Path(path)
    text = _read_text(p, allow_large=allow_large)
    rows: list[tuple[Action | None, ...]] = []
    dropped: Counter[str] = Counter()
    count = num_cells = 0
    if not allow_large:
        num_cells = text.count(",") + text.count("\n")  # counted before csv splits one huge line into a list
        _check_cells(p, num_cells, action_limit)
        num_cells = 0
        num_compute = sum(1 for _ in _COMPUTE_TOKEN.finditer(text))  # ~0.1 s per million, before parsing
        if num_compute > action_limit:
            raise limits.WorkLimitError(
                f"schedule file {str(p)!r} holds about {num_compute:,} compute actions, beyond the limit of "
                f"{action_limit:,}{' for a figure' if figure else ''}; pass a smaller file, or "
                f"{limits.OVERRIDE_FLAG} to go ahead anyway"
            )
    try:
        for r, cells in enumerate(csv.reader(io.StringIO(text))):
            row: list[Action | None] = []
            for c, cell in enumerate(cells):
                try:
                    action = parse_action(cell)
                except ScheduleFormatError as exc:
                    raise ScheduleFormatError(f"{display_path(p)}: rank {r}, position {c}: {exc}") from None
                if action is not None and not action.is_compute:
                    dropped[action.type.value] += 1
                    continue
                row.append(action)
            count += sum(1 for a in row if a is not None)
            num_cells += len(cells)
            if not allow_large:
                _check_cells(p, num_cells, action_limit)
            if not allow_large and (count > action_limit or r >= rank_limit):
                over = count > action_limit
                what = f"{count:,} actions" if over else f"{r + 1:,} rows (ranks)"
                limit = f"{action_limit:,} actions" if over else f"{rank_limit:,} ranks"
                raise limits.WorkLimitError(
                    f"schedule file {str(p)!r} has more than {what} (read so far), beyond the limit of {limit}"
                    f"{' for a figure' if figure else ''}; pass a smaller file, or {limits.OVERRIDE_FLAG} to "
                    "go ahead anyway"
                )
            rows.append(tuple(row))
    except csv.Error as exc:
        raise ScheduleFormatError(
            f"{display_path(p)}: not a CSV file ({exc}); pass torch's schedule CSV, one row per rank"
        ) from None
    while rows and not any(a is not None for a in rows[-1]):
        rows.pop()  # trailing blank lines
    if not rows:
        raise ScheduleFormatError(
            f"schedule file {str(p)!r} is empty: expected one row of actions per rank, e.g. 0F0,0B0"
        )
    return ScheduleFile(str(p), tuple(rows), tuple(sorted(dropped.items())))


def display_path(path: str | os.PathLike[str], limit: int = 120) -> str:
    """A path for a one-line message: control characters escaped, very long names shortened."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(path))
    return text if len(text) <= limit else f"{text[:60]}...{text[-30:]}"


def _check_cells(p: Path, num_cells: int, action_limit: int) -> None:
    if num_cells > 4 * action_limit:
        raise limits.WorkLimitError(
            f"schedule file {str(p)!r} has more than {num_cells:,} cells, beyond the limit of {4 * action_limit:,} "
            f"cells (4 per action, idle cells included); pass a smaller file, or {limits.OVERRIDE_FLAG} to go ahead "
            "anyway"
        )


def _read_text(p: Path, *, allow_large: bool) -> str:
    """The file's text, refusing anything that is not a readable, UTF-8, regular file of bounded size."""
    shown = str(p) if len(str(p)) <= 80 else f"{str(p)[:60]}... ({len(str(p)):,} characters)"
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ScheduleFormatError(
            f"schedule file {shown!r} not found: check the path (a CSV with one row per rank)"
        ) from None
    except OSError as exc:
        raise ScheduleFormatError(f"schedule file {shown!r}: {_os_reason(exc)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ScheduleFormatError(f"schedule file {shown!r} is a directory: pass a CSV file with one row per rank")
    if not stat.S_ISREG(st.st_mode):
        raise ScheduleFormatError(
            f"schedule file {shown!r} is not a regular file (a FIFO, socket or device): save the schedule to a "
            "CSV file and pass that"
        )
    limits.check_file_size(shown, st.st_size, allow_large=allow_large)
    try:
        with open(p, "rb") as fh:
            data = fh.read() if allow_large else fh.read(limits.MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ScheduleFormatError(f"schedule file {shown!r}: {_os_reason(exc)}") from None
    limits.check_file_size(shown, len(data), allow_large=allow_large)  # files whose size stat does not tell
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if data.startswith(bom):
            raise ScheduleFormatError(
                f"schedule file {shown!r} is {name} text: save it as UTF-8 (or ASCII), e.g. "
                f"`iconv -f {name} -t UTF-8`"
            )
    if b"\0" in data:
        raise ScheduleFormatError(
            f"schedule file {shown!r} is binary (it holds NUL bytes), not a CSV: pass torch's schedule CSV"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ScheduleFormatError(
            f"schedule file {shown!r} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start:,}): "
            "save it as UTF-8 (or ASCII)"
        ) from None


def _os_reason(exc: OSError) -> str:
    """One line for an OS refusal to read a path."""
    if exc.errno == errno.ENAMETOOLONG:
        return "the file name is longer than the file system allows (255 bytes per name); choose a shorter name"
    if isinstance(exc, PermissionError):
        return "permission denied; make the file readable or copy it somewhere you can read"
    return f"cannot be read ({exc.strerror or exc}); check the path"


def schedule_from_rows(
    rows: tuple[tuple[Action | None, ...], ...],
    *,
    name: str,
    num_microbatches: int | None = None,
    num_pipelines: int = 1,
) -> Schedule:
    """Build a :class:`Schedule` from per-rank cells, inferring placement, stages and microbatches.

    Raises :class:`ScheduleStructureError` when the cells cannot describe one schedule (a stage on two ranks, stage
    ids with gaps); finer problems are :func:`ppsim.validate.validate`'s job.
    """
    stage_to_rank: dict[int, int] = {}
    mb_ids: set[int] = set()
    for r, row in enumerate(rows):
        for c, action in enumerate(row):
            if action is None:
                continue
            for comp in action.computations:
                owner = stage_to_rank.setdefault(comp.stage, r)
                if owner != r:
                    raise ScheduleStructureError(
                        f"{name}: rank {r}, position {c}: action {action} runs stage {comp.stage}, which rank {owner} "
                        "already runs; each stage must live on exactly one rank"
                    )
                if comp.microbatch is not None:
                    mb_ids.add(comp.microbatch)
    # Sizes come from how many stages and microbatches the file names, never from its largest id.
    num_stages = len(stage_to_rank)
    if num_stages == 0:
        raise ScheduleStructureError(f"{name}: no compute action in the file; expected actions like 0F0,0B0")
    beyond = sorted(s for s in stage_to_rank if s >= num_stages)
    if beyond:
        missing = sorted(set(range(num_stages)) - stage_to_rank.keys())
        raise ScheduleStructureError(
            f"{name}: stages must be numbered 0..S-1 without gaps; the file names {num_stages} stages but uses "
            f"stage {_few(beyond)} and never stage {_few(missing)}; renumber the stages from 0"
        )
    if num_pipelines < 1 or num_stages % num_pipelines:
        raise ScheduleStructureError(
            f"{name}: {num_stages} stages cannot form {num_pipelines} equal pipelines; use --directions 1"
        )
    chain = num_stages // num_pipelines
    pipelines = tuple(tuple(range(d * chain, (d + 1) * chain)) for d in range(num_pipelines))
    m = len(mb_ids) * num_pipelines if num_microbatches is None else num_microbatches
    if m < 1:
        raise ScheduleStructureError(f"{name}: no microbatch appears in any action; expected actions like 0F0")
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


def _few(ids: list[int], shown: int = 5) -> str:
    text = ", ".join(str(i) for i in ids[:shown])
    return text + (f" and {len(ids) - shown:,} more" if len(ids) > shown else "")


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
