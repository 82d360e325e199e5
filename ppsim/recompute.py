"""Activation recomputation (checkpointing): which (stage, microbatch) activations are dropped after their forward.

A recomputed (stage, microbatch) keeps only its boundary input after its F and runs its forward again just before
its backward: the simulator adds F to that B (or I, or the backward half of an overlapped pair), and in the memory
model the F holds only the boundary (``StageCosts.recompute_kept``: the stage input's bytes with a profile,
``recompute_act`` of one activation with a cost string); the recompute brings back the rest, and the backward
releases as usual. docs/simulator.md states the memory model, docs/search.md how ``search --recompute auto`` chooses.

The set is written beside a schedule CSV as ``<csv stem>.recompute.json`` (:func:`sidecar_path`), which
``simulate``/``plot``/``report -s FILE.csv`` read when present.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from ppsim.errors import PPSimError
from ppsim.ir import ActionType, Schedule

SCHEMA = "ppsim.recompute"
VERSION = 1
SIDECAR_SUFFIX = ".recompute.json"


class RecomputeError(PPSimError):
    """A recompute option or file is malformed or does not match its schedule."""


class Recompute(str, Enum):
    """``--recompute``: nothing, every (stage, microbatch), or (``search`` only) chosen to meet the cap."""

    none = "none"
    full = "full"
    auto = "auto"


class RecomputeSet(frozenset):
    """A frozen set of recomputed ``(stage, microbatch)`` pairs (the simulator takes any set of such pairs)."""

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> RecomputeSet:
        return cls((int(s), int(m)) for s, m in pairs)

    @classmethod
    def full(cls, schedule: Schedule) -> RecomputeSet:
        """Every (stage, microbatch) the schedule computes."""
        return cls(
            (c.stage, c.microbatch)
            for row in schedule.actions
            for a in row
            for c in a.computations
            if c.type is ActionType.F and c.microbatch is not None
        )

    def sorted(self) -> list[list[int]]:
        return [list(p) for p in sorted(self)]

    def check(self, schedule: Schedule, *, source: str = "--recompute") -> None:
        """Raise :class:`RecomputeError` unless every pair is a (stage, microbatch) the schedule runs a forward of."""
        unknown = self - RecomputeSet.full(schedule)
        if unknown:
            s, m = min(unknown)
            raise RecomputeError(
                f"{source}: ({s}, {m}) is not a (stage, microbatch) of {schedule.name} ({schedule.num_stages} stages, "
                f"{schedule.num_microbatches} microbatches); list only pairs the schedule computes"
            )

    def to_dict(self, schedule: Schedule, **extra: Any) -> dict[str, Any]:
        """The sidecar JSON object: ``{"schema", "version", "schedule", "ranks", "microbatches", "stages",
        "recompute": [[stage, microbatch], ...], ...extra}``."""
        return {
            "schema": SCHEMA, "version": VERSION, "schedule": schedule.name, "ranks": schedule.num_ranks,
            "microbatches": schedule.num_microbatches, "stages": schedule.num_stages, "recompute": self.sorted(),
            **extra,
        }


def sidecar_path(csv_path: str | Path) -> Path:
    """``best.csv`` -> ``best.recompute.json``: where the recompute set of a schedule CSV is written and read."""
    path = Path(csv_path)
    return path.with_name(path.stem + SIDECAR_SUFFIX)


def write_sidecar(path: str | Path, recompute: RecomputeSet, schedule: Schedule, **extra: Any) -> Path:
    from ppsim.io import write_atomic

    data = recompute.to_dict(schedule, **extra)
    pairs = data.pop("recompute")
    head = json.dumps(data, indent=1)[:-2]  # one pair per line: readable, and diffs show what changed
    body = ",\n".join(f"  {json.dumps(p)}" for p in pairs)
    return write_atomic(path, f'{head},\n "recompute": [\n{body}\n ]\n}}\n' if pairs else
                        f'{head},\n "recompute": []\n}}\n')


def read_sidecar(path: str | Path, schedule: Schedule) -> RecomputeSet:
    """The set in a recompute JSON file, checked against ``schedule`` (one-line :class:`RecomputeError`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecomputeError(f"--recompute {path}: cannot read it ({exc.strerror or exc}); give an existing "
                             "recompute JSON written by `ppsim search --recompute auto`") from None
    except UnicodeDecodeError:
        raise RecomputeError(f"--recompute {path}: not UTF-8 text; give a recompute JSON file") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RecomputeError(f"--recompute {path}: not JSON ({exc}); give a recompute JSON file") from None
    pairs = data.get("recompute") if isinstance(data, dict) else None
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(v) is int and v >= 0 for v in p) for p in pairs
    ):
        raise RecomputeError(f"--recompute {path}: needs a key \"recompute\" holding [[stage, microbatch], ...] of "
                             "integers >= 0; write it as `ppsim search --recompute auto` does")
    for key, want in (("ranks", schedule.num_ranks), ("microbatches", schedule.num_microbatches),
                      ("stages", schedule.num_stages)):
        got = data.get(key)
        if got is not None and got != want:
            raise RecomputeError(f"--recompute {path}: written for {key}={got} but the schedule has {key}={want}; "
                                 "use the file beside the CSV it was written with")
    out = RecomputeSet.of(tuple(p) for p in pairs)
    out.check(schedule, source=f"--recompute {path}")
    return out


def resolve(option: str | None, schedule: Schedule, *, csv_path: str | Path | None = None) -> tuple[RecomputeSet, str]:
    """The set ``--recompute`` asks for on ``schedule``, and a note for stderr ('' when none).

    ``none``/``full`` (case-insensitive) or a JSON file. Without the option, a CSV schedule with a
    ``<stem>.recompute.json`` beside it gets that file's set (said in the note); ``none`` turns that off. ``auto`` is
    the search's: it is refused here with the command to run."""
    if option is None:
        if csv_path is not None and sidecar_path(csv_path).is_file():
            side = sidecar_path(csv_path)
            try:
                found = read_sidecar(side, schedule)
            except RecomputeError as exc:
                raise RecomputeError(f"{exc} (found beside {csv_path}; --recompute none ignores it)") from None
            return found, f"note: recomputing as {side} says (found beside {csv_path}; --recompute none ignores it)"
        return RecomputeSet(), ""
    mode = option.strip().lower()
    if mode == Recompute.none.value:
        return RecomputeSet(), ""
    if mode == Recompute.full.value:
        return RecomputeSet.full(schedule), ""
    if mode == Recompute.auto.value:
        raise RecomputeError("--recompute auto: the set is chosen by `ppsim search --recompute auto --memory-cap CAP "
                             "-o best.csv`, which writes it beside the CSV; then pass -s best.csv here")
    if option.lower().endswith(".json"):
        return read_sidecar(option, schedule), ""
    raise RecomputeError(f"--recompute {option!r}: use none, full or a recompute JSON file (FILE.json)")
