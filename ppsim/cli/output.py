"""Printing that imports nothing heavy (no typer, no numpy): JSON, the rich console and the schedule listing, so the
short commands' fast path in :func:`ppsim.cli.main` can print exactly what their typer commands print."""

from __future__ import annotations

import json
import sys
from typing import Any


def echo_json(obj: Any) -> None:
    """``obj`` as indented JSON and a newline on stdout (the bytes ``typer.echo`` writes: the text is ASCII)."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


#: the width tables get when the output is not a terminal (a pipe, a file, a test runner): wide enough that no cell
#: is cut ("Interleaved…") or wrapped mid-word; a table is only as wide as its contents, so nothing is padded
UNCUT_WIDTH = 10_000


def console(*, stderr: bool = False) -> Any:
    """The rich console every table is printed on: the terminal's width on a terminal; piped or redirected, wide
    enough that every table prints whole (the one place this is decided)."""
    from rich.console import Console

    out = Console(stderr=stderr)
    return out if out.is_terminal else Console(stderr=stderr, width=UNCUT_WIDTH)


def print_schedules(*, json_out: bool) -> None:
    """`ppsim list`: every schedule with its stages per rank, constraints and description, as a table or JSON."""
    from ppsim.schedules import all_specs

    rows: list[dict[str, Any]] = [
        {
            "name": s.name,
            "aliases": list(s.aliases),
            "stages_per_rank": s.stages_per_rank_text,
            "constraints": s.constraints,
            "description": s.description,
            "torch": s.torch_name,
        }
        for s in all_specs()
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
