"""The search's choices as the command line offers them (no heavy imports: ``ppsim --help`` reads them)."""

from __future__ import annotations

from enum import Enum

SEARCH_NAME = "Searched"


class Placement(str, Enum):
    """Where stages live: ``loop`` (stage s on rank s % R), ``v`` (rank r holds r and 2R-1-r), ``any`` (both)."""

    loop = "loop"
    v = "v"
    any = "any"


class Solver(str, Enum):
    """Whether to polish with CP-SAT: when OR-Tools is importable (``auto``), always (``cpsat``), never."""

    auto = "auto"
    cpsat = "cpsat"
    none = "none"
