"""ppsim: generate, simulate, draw, calibrate and execute pipeline-parallel training schedules.

The core package is plain Python (no torch, no matplotlib at import time). The names below load on first use
(PEP 562), so ``ppsim --version`` and ``ppsim list`` do not pay for numpy and the simulator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_HOMES = {
    "CostSpec": "ppsim.costs",
    "StageCosts": "ppsim.costs",
    "load_costs": "ppsim.costs",
    "parse_costs": "ppsim.costs",
    "DeadlockError": "ppsim.errors",
    "PPSimError": "ppsim.errors",
    "ScheduleConfigError": "ppsim.errors",
    "ScheduleFormatError": "ppsim.errors",
    "Action": "ppsim.ir",
    "ActionType": "ppsim.ir",
    "Schedule": "ppsim.ir",
    "parse_action": "ppsim.ir",
    "load_schedule": "ppsim.schedules.loading",
    "RankStats": "ppsim.result",
    "SimResult": "ppsim.result",
    "all_specs": "ppsim.schedules",
    "get_schedule": "ppsim.schedules",
    "get_spec": "ppsim.schedules",
    "simulate": "ppsim.simulator",
}

__all__ = [*_HOMES, "__version__"]

if TYPE_CHECKING:
    from ppsim.costs import CostSpec, StageCosts, load_costs, parse_costs
    from ppsim.errors import DeadlockError, PPSimError, ScheduleConfigError, ScheduleFormatError
    from ppsim.ir import Action, ActionType, Schedule, parse_action
    from ppsim.result import RankStats, SimResult
    from ppsim.schedules import all_specs, get_schedule, get_spec
    from ppsim.schedules.loading import load_schedule
    from ppsim.simulator import simulate


def __getattr__(name: str) -> Any:
    """A public name loads its home on first use (PEP 562); ``ppsim.simulate`` is the function (its module is
    ``ppsim.simulator``)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ppsim' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
