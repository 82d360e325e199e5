"""Schedule search: the fastest order found for given costs under a per-rank memory cap.

Method (see docs/search.md):

1. Every named schedule whose placement matches is simulated; those that fit the cap are the baseline, and the best
   of them is a starting point.
2. Seeds (:mod:`ppsim.search.seeds`): for one stage per rank the zero-bubble authors' greedy auto-scheduler, for V
   placement their automatic V schedule and the controllable-memory building blocks that fit the cap; then
   memory-aware list scheduling (:mod:`ppsim.search.listsched`) with a handful of fixed priority rules, then with
   random rules (admission limits per rank, when deferred W run, B or I+W, overlapped pairs) until the time limit
   (:mod:`ppsim.search.rules`).
3. Local search on the best orders (:mod:`ppsim.search.local`): single actions moved within their rank's order, each
   candidate re-simulated by :func:`ppsim.simulator` (the judge), kept when the makespan drops and every rank still
   fits the cap.
4. With OR-Tools installed (``pip install ppsim[search]``), CP-SAT polishes the best order before the local search
   (:mod:`ppsim.search.cpsat`); without it the search works the same, minus that step. The result is never worse
   than the best named schedule that fits.

The lower bound is :func:`ppsim.search.bounds.lower_bound`. The phases are in :mod:`ppsim.search.driver`.
Deterministic for a seed; honours a time limit; Ctrl-C returns the best so far.

| module | holds |
|---|---|
| ``choices`` | the command line's choices (:class:`Placement`, :class:`Solver`), cheap to import |
| ``common`` | the value types (:class:`MemoryCap`, :class:`SearchResult`, ...) and the helpers every phase shares |
| ``driver`` | :func:`search`, split by phase |
| ``bounds`` | :func:`lower_bound`, :func:`smallest_cap` |
| ``seeds`` | the seed orders that fit the cap: the families below and the controllable-memory building blocks |
| ``vgreedy`` | the greedy V construction (the zero-bubble authors' ZB-V greedy, rebuilt) at a memory level |
| ``zbgreedy`` | the zero-bubble authors' greedy auto-scheduler (one stage per rank), rebuilt |
| ``vauto`` | the zero-bubble authors' automatic V schedule (``v_auto_schedule``), rebuilt |
| ``rules`` | the list-scheduling rules: fixed, random, mutated |
| ``local`` | local search on one order |
| ``cpsat`` | the optional CP-SAT model |
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "SEARCH_NAME": "ppsim.search.choices",
    "Placement": "ppsim.search.choices",
    "Solver": "ppsim.search.choices",
    "MemoryCap": "ppsim.search.common",
    "MemoryCapError": "ppsim.search.common",
    "NamedResult": "ppsim.search.common",
    "Progress": "ppsim.search.common",
    "SearchResult": "ppsim.search.common",
    "parse_memory_cap": "ppsim.search.common",
    "lower_bound": "ppsim.search.bounds",
    "smallest_cap": "ppsim.search.bounds",
    "search": "ppsim.search.driver",
}
"""Where each public name lives: loaded on first use (PEP 562), so the CLI's option types cost no solver import."""

if TYPE_CHECKING:
    from ppsim.search.bounds import lower_bound, smallest_cap
    from ppsim.search.choices import SEARCH_NAME, Placement, Solver
    from ppsim.search.common import MemoryCap, MemoryCapError, NamedResult, Progress, SearchResult, parse_memory_cap
    from ppsim.search.driver import search


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ppsim.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "SEARCH_NAME",
    "MemoryCap",
    "MemoryCapError",
    "NamedResult",
    "Placement",
    "Progress",
    "SearchResult",
    "Solver",
    "lower_bound",
    "parse_memory_cap",
    "search",
    "smallest_cap",
]
